"""The router's settings: one YAML file (what the operator mounts) or command-line flags."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from copse.router.adapters import AdapterRouting
from copse.router.clients import ClientLimits
from copse.router.core import DisaggSettings, Role, Thresholds
from copse.router.limits import TenantLimits
from copse.router.metrics import SloTargets
from copse.router.models import Adapter, ModelCatalog
from copse.router.objective_source import DEFAULT_API_VERSION
from copse.router.objectives import Classes, Objective
from copse.router.policies import POLICIES, RoutingObjective, SelectionSettings
from copse.workers.files import read_yaml_mapping
from copse.workers.perf import KvOffload
from copse.workers.protocol.hashing import lora_int_id
from copse.workers.protocol.limits import DEFAULT_CONTEXT_TOKENS, RequestLimits
from copse.workers.serving import DEFAULT_MAX_BODY_BYTES


class ConfigError(ValueError):
    """Settings that cannot be used; the message names the file, the field and the value."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StaticWorker(_Model):
    """One worker of a static list."""

    url: str = Field(pattern=r"^https?://[^/\s]+$")
    """Base URL of the engine's HTTP server (scheme, host and port, no path)."""
    role: Role = Role.WORKER
    """``worker`` serves whole requests; ``prefill`` and ``decode`` form a disaggregated pair."""
    id: str | None = None
    """Worker id its KV events carry; asked from its ``/worker_info`` when absent."""
    locality: str | None = None
    """Workers sharing a locality (e.g. NVLink domain) exchange KV cheaply."""


class StaticDiscovery(_Model):
    """A fixed list of workers (local runs, tests); each is probed and dropped while it fails."""

    kind: Literal["static"]
    workers: list[StaticWorker] = Field(min_length=1)


class KubernetesDiscovery(_Model):
    """Worker pods found by label, ready ones only."""

    kind: Literal["kubernetes"]
    namespace: str = Field(min_length=1)
    """Namespace of the InferenceDeployment and its pods."""
    selector: str = Field(min_length=1)
    """Label selector of the rank-0 worker pods (the operator sets it)."""
    port: int = Field(default=8000, ge=1, le=65535)
    """Port of the engine's HTTP server on the pod IP."""


class InferencePoolDiscovery(_Model):
    """The ready pods of a Gateway API Inference Extension ``InferencePool``
    (``inference.networking.k8s.io/v1``): its ``spec.selector.matchLabels`` and the first of its
    ``spec.targetPorts``, followed as the pool changes."""

    kind: Literal["inferencepool"]
    namespace: str = Field(min_length=1)
    """Namespace of the pool and its pods."""
    name: str = Field(min_length=1)
    """Name of the InferencePool (the endpoint picker's ``--pool-name``)."""


Discovery = Annotated[
    StaticDiscovery | KubernetesDiscovery | InferencePoolDiscovery, Field(discriminator="kind")
]


class EppSettings(_Model):
    """Serving as a Gateway API Inference Extension endpoint picker: an Envoy ext_proc gRPC server
    that tells the gateway which worker serves each request (the gateway carries the tokens)."""

    grpc_port: int = Field(default=9002, ge=0, le=65535)
    """Port of the ext_proc service (and gRPC health); 9002 is the endpoint picker's usual port
    (0 picks a free one)."""
    health_port: int | None = Field(default=9003, ge=0, le=65535)
    """A second port serving only gRPC health (the endpoint picker's usual 9003, what probes use);
    ``None``: health on the ext_proc port alone."""
    metrics_port: int | None = Field(default=9090, ge=0, le=65535)
    """HTTP port of ``/metrics`` and ``/health``; ``None``: no HTTP server."""
    fallback_endpoints: int = Field(default=0, ge=0, le=7)
    """Other workers listed after the chosen one in ``x-gateway-destination-endpoint``, where the
    gateway retries when the chosen one fails before answering. Only for gateways that follow the
    list (Envoy's override_host load balancing policy; an ORIGINAL_DST cluster takes a single
    address, so keep 0 there)."""


MODEL_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"
"""What a model or adapter name may look like (what requests send as ``model``)."""


class LoraSettings(_Model):
    """A LoRA adapter of a base model, which requests name as ``model``."""

    name: str = Field(pattern=MODEL_NAME)
    """The name requests use (unique among the router's models and adapters)."""
    path: str = ""
    """Where the engines read its weights, inside the worker pod (sent to ``trtllm-serve`` as
    ``lora_request.lora_path``; the operator mounts the adapter there): required with
    ``engine: trtllm``. Mocked engines ignore it."""


class ServedModel(_Model):
    """A further model behind this router: its adapters and where its workers are."""

    name: str = Field(pattern=MODEL_NAME)
    """The base model's name (what requests send as ``model``)."""
    loras: list[LoraSettings] = Field(default_factory=list)
    """Its LoRA adapters."""
    discovery: Discovery
    """Its workers (a static list, or the pods of its own deployment)."""
    deployment: str | None = Field(default=None, min_length=1)
    """Its deployment's name: the NATS subject its engines publish KV events on (required with
    ``nats_url``, or its workers' caches stay unknown)."""
    namespace: str | None = None
    """Namespace of that subject; default: its discovery's, else the router's."""


EngineKind = Literal["trtllm", "mock"]
"""What serves behind a router."""


class KvOffloadSettings(_Model):
    """How fast the engines bring KV blocks they keep below the GPU back (the blocks' tier comes
    from their KV events); the block's bytes are ``block_size x kv_transfer.kv_bytes_per_token``."""

    host_gbps: float = Field(default=KvOffload().host_gbps, gt=0)
    """Host-to-GPU bandwidth of the engines, GB/s."""
    disk_gbps: float = Field(default=KvOffload().disk_gbps, gt=0)
    """Disk-to-GPU bandwidth of the engines, GB/s."""


class ObjectiveSettings(_Model):
    """A serving objective (what an ``InferenceObjective`` gives, plus its TTFT target)."""

    priority: int = 0
    """Higher is served first while requests wait and shed last (``InferenceObjective``
    ``spec.priority``)."""
    ttft_ms: float | None = Field(default=None, gt=0)
    """Time-to-first-token target: while the fleet is saturated, a request the router predicts
    would wait past it is answered 429 at once instead of queued; none: queued while there is room."""
    itl_ms: float | None = Field(default=None, gt=0)
    """Inter-token target: while requests of this objective decode on a worker, a request of lower
    priority is sent there only if the latency model predicts the worker's steps (its decode batch
    plus a chunk of the prefill it would then hold) stay within it; otherwise elsewhere, or it
    waits, and is shed when that wait passes its own TTFT target. None: no such guard."""

    def objective(self, name: str) -> Objective:
        return Objective(name=name, priority=self.priority, ttft_ms=self.ttft_ms, itl_ms=self.itl_ms)


class InferenceObjectiveSettings(_Model):
    """Reading ``InferenceObjective`` objects from Kubernetes (:mod:`copse.router.objective_source`)."""

    pool: str | None = Field(default=None, min_length=1)
    """Only the objects whose ``spec.poolRef.name`` is this InferencePool (the operator sets the
    deployment's name); none: every object of the namespace."""
    namespace: str | None = Field(default=None, min_length=1)
    """Namespace of the objects; the router's ``namespace`` (its discovery's) when absent."""
    api_version: str = Field(default=DEFAULT_API_VERSION, pattern=r"^[a-z0-9.-]+/v[a-z0-9]+$")
    """Group/version of the objects: the Inference Extension's (up to v1.5.0), or ``llm-d.ai/v1alpha2``
    where llm-d's router defines them."""
    interval_s: float = Field(default=10.0, gt=0)
    """How often the objects are listed: a changed priority applies to requests from then on."""


class SloSettings(_Model):
    """The deployment's per-request SLO, which the router judges every request by
    (``copse_router_slo_requests_total``: the planner's fast loop scales up on its burn rate)."""

    ttft_ms: float = Field(gt=0)
    """Time-to-first-token target (the operator sets it from ``spec.scaling.targetLatency``)."""
    itl_ms: float = Field(gt=0)
    """Target of a request's mean inter-token gap (TPOT)."""

    def targets(self) -> SloTargets:
        return SloTargets(ttft_s=self.ttft_ms / 1000.0, itl_s=self.itl_ms / 1000.0)


class TenantSettings(_Model):
    """A tenant's share and limit."""

    weight: float = Field(default=1.0, gt=0)
    """Its share of the fleet against the other tenants of the same priority while requests wait."""
    tokens_per_minute: float | None = Field(default=None, gt=0)
    """Prompt plus ``max_tokens`` tokens it may send per minute (429 with Retry-After beyond);
    none: unlimited."""


class RouterConfig(_Model):
    """Everything ``copse router run`` needs."""

    model: str = Field(min_length=1)
    """Model name served (requests naming another model get 404)."""
    host: str = "127.0.0.1"
    """Address to listen on (the operator's pods use 0.0.0.0)."""
    port: int = Field(default=8080, ge=0, le=65535)
    """Port to listen on (0 picks a free one)."""
    policy: str = "kv"
    """Worker selection policy (see ``copse.router.policies``)."""
    temperature: float = Field(default=0.0, ge=0.0)
    """Softmax temperature of selection; 0 always picks the best worker."""
    queue_size: int = Field(default=Thresholds().queue_size, ge=0)
    """Requests that may wait while every worker is busy, of the new request's priority or higher;
    beyond it the router answers 429 (a queue full of batch requests does not refuse premium)."""
    block_size: int = Field(default=32, ge=1)
    """Tokens per KV block of the engines (TensorRT-LLM's ``tokens_per_block``)."""
    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, ge=1024)
    """Largest request body the router reads, over HTTP or as an endpoint picker (a larger one gets
    413): long-context and agentic prompts and base64 images run to tens of MB (a 1M-token chat is
    ~5 MB of text)."""
    max_context_tokens: int = Field(default=DEFAULT_CONTEXT_TOKENS, ge=2)
    """The engines' context (TensorRT-LLM's ``max_seq_len``): a request whose ``max_tokens``, or
    prompt plus ``max_tokens``, exceeds it gets a 400 naming it before anything is allocated for it
    (the operator sets it from ``spec.engine.maxSeqLen``)."""
    limits: RequestLimits = Field(default_factory=RequestLimits)
    """Bounds on a request's JSON nesting, messages, content parts, texts, stop lists and
    ``logit_bias`` (each breach a 400 naming the limit)."""
    clients: ClientLimits = Field(default_factory=ClientLimits)
    """Per-client bounds (requests, streams), the bytes of bodies held, and the timeouts of slow
    or absent clients (:mod:`copse.router.clients`)."""
    api_keys_file: Path | None = None
    """A file of API keys, one per line (the operator mounts ``spec.router.auth``'s Secret): the
    OpenAI paths then need ``Authorization: Bearer <key>`` (401 without). Re-read when it changes.
    An endpoint picker ignores it: there the gateway authenticates."""
    tokenize_inline_bytes: int = Field(default=64 * 1024, ge=0)
    """Request bodies up to this size are tokenized on the event loop (a thread hop costs more than
    encoding them); larger ones on the tokenizer threads, so that other streams keep flowing while a
    multi-megabyte prompt encodes."""
    tokenize_threads: int = Field(default=2, ge=1)
    """Threads tokenizing large prompts (``tokenizers`` releases the GIL while it encodes)."""
    nats_url: str | None = None
    """NATS server for KV events and load sharing between router replicas; without it the router
    learns caches from its own decisions (approximate indexer)."""
    deployment: str = Field(default="copse", min_length=1)
    """InferenceDeployment name (part of the NATS subjects)."""
    namespace: str = "default"
    """Namespace part of the NATS subjects (taken from Kubernetes discovery when set there)."""
    discovery: Discovery
    engine: EngineKind
    """What serves behind the router: ``trtllm`` (a real ``trtllm-serve``) or ``mock`` (copse's
    mocked engines). It decides how text prompts are tokenized and where the engines' KV capacity
    comes from; there is no default, so a router never guesses."""
    tokenizer: Path | None = None
    """Model directory holding the engines' ``tokenizer.json`` and ``tokenizer_config.json`` (and
    ``chat_template.jinja`` when the model has one): required with ``engine: trtllm`` (text and chat
    prompts are tokenized as ``trtllm-serve`` does); mocked engines use copse's byte tokenizer."""
    perf_profile: Path | None = None
    """Perf profile of the engines (NPZ/JSON, ``copse planner profile``): predicted TTFT/ITL and,
    unless ``kv_capacity_tokens`` says otherwise, the KV capacity; copse's polynomial model without it."""
    kv_capacity_tokens: int | None = Field(default=None, ge=1)
    """KV cache size of one engine, tokens (busy threshold, approximate cache size, latency model):
    with ``engine: trtllm`` this or a perf profile is required (TensorRT-LLM sizes its cache from free
    GPU memory, which only the engine knows); mocked engines run copse's default model without it."""
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    """Engines' per-step token budget (prefill steps a prompt needs)."""
    objective: RoutingObjective = "e2e"
    """What the ``kv`` policy minimises for each request: ``e2e``, its predicted end-to-end latency
    (time to first token, its decode under the batch it joins, and what joining costs the streams
    already there: see benchmarks/RESULTS.md, "Routing objective"), or ``ttft``, its time to first
    token (plus ``decode_weight`` x its decode time): the fastest first token, at the cost of
    slower streams on prefix holders; or ``goodput``, ``e2e`` among the workers predicted to meet
    the request's objective's TTFT target (``objectives``), the others only when none does."""
    decode_weight: float = Field(default=0.0, ge=0.0)
    """Under ``objective: ttft``, weight of the request's predicted decode time against its time to
    first token in the ``kv`` cost (ignored under ``e2e`` and ``goodput``)."""
    busy_prefill_tokens: float = Field(default=Thresholds().busy_prefill_tokens, gt=0)
    """Outstanding prefill tokens beyond which a worker takes no new request."""
    contended_prefill_tokens: float | None = Field(default=None, gt=0)
    """While other tenants of a request's priority, or any of a higher one, were routed over
    ``rate_window_s`` (the fair queue's order then matters), the request goes only to a worker
    where its uncached prompt fits in this many tokens beside the prefill queued there, or with
    none queued; unset: one engine step, ``max_num_batched_tokens`` (see
    ``copse.router.core.Thresholds.contended_prefill_tokens``)."""
    busy_kv_fraction: float = Field(default=Thresholds().busy_kv_fraction, gt=0)
    """KV use (fraction of the cache) beyond which a worker takes no new request."""
    max_retries: int = Field(default=2, ge=0)
    """Other workers tried when a worker fails before the first token."""
    queue_timeout_s: float = Field(default=30.0, gt=0)
    """Longest wait in the queue before the router answers 429 (a last resort: admission sheds
    requests predicted to miss their objective's TTFT target before they wait)."""
    migration_limit: int = Field(default=3, ge=0)
    """Times a stream whose worker fails after its first token is continued on another worker (from
    the prompt and the tokens already streamed); 0 ends such streams with an error event."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Longest a worker may take to answer (or to send the next chunk of a stream)."""
    token_timeout_s: float = Field(default=30.0, gt=0)
    """Longest a stream may stay silent after its first token before the router gives up on its
    worker and migrates it (an engine stuck on it while its health probe passes; a decode step
    takes milliseconds, a preempted sequence's recompute seconds)."""
    health_interval_s: float = Field(default=0.25, gt=0)
    """Period of worker health probes: a dead worker is dropped within interval + timeout."""
    health_timeout_s: float = Field(default=0.5, gt=0)
    """Timeout of one health probe."""
    health_failures: int = Field(default=3, ge=1)
    """Slow or failed probes in a row before a worker that still accepts connections is dropped."""
    peer_timeout_s: float = Field(default=5.0, gt=0)
    """A peer router silent this long is considered gone and its load forgotten."""
    peer_queue_max_age_s: float = Field(default=Thresholds().peer_queue_max_age_s, gt=0)
    """How long a peer router's queue head holds this router's dispatch back at most, from when the
    peer first sent it (a request waiting at a peer that comes first in the fair order takes freed
    capacity first); peers re-send their heads every second, so a dead or cut-off peer, or a head
    its peer cannot route, stops holding anything back after this."""
    nats_reconnect_max_s: float = Field(default=8.0, gt=0)
    """Longest wait between attempts to reach NATS (the wait doubles from 0.25 s up to it)."""
    recovery_timeout_s: float = Field(default=15.0, gt=0)
    """Longest a starting router waits for its workers' KV dumps, a NATS connection and its peers'
    load snapshots before it reports ready anyway (serving with what it has)."""
    drain_timeout_s: float = Field(default=25.0, ge=0)
    """On SIGTERM, how long the router keeps serving what is in flight (not ready meanwhile) before
    it exits; below the pod's terminationGracePeriodSeconds (30 by default)."""
    kv_transfer: DisaggSettings = Field(default_factory=DisaggSettings)
    """What moving KV from a prefill to a decode worker costs (disaggregated routing)."""
    kv_offload: KvOffloadSettings = Field(default_factory=KvOffloadSettings)
    """What bringing back a KV block an engine keeps in host memory or on disk costs."""
    seed: int | None = None
    """Seed of tie-breaking (reproducible runs); random when absent."""
    objectives: dict[str, ObjectiveSettings] = Field(default_factory=dict)
    """Objectives by name, as requests name them in ``x-gateway-inference-objective`` (the names
    of the InferenceObjectives a gateway's clients use), with their TTFT targets."""
    inference_objectives: InferenceObjectiveSettings | None = None
    """Read the priorities of the InferenceObjective objects in Kubernetes too (an object's priority
    wins over ``objectives`` for the same name); none: the config's objectives only."""
    default_objective: ObjectiveSettings = Field(default_factory=ObjectiveSettings)
    """The objective of requests naming none or one the router does not know."""
    tenants: dict[str, TenantSettings] = Field(default_factory=dict)
    """Tenants by name: the ``x-gateway-inference-fairness-id`` header, or ``key-`` and the first
    16 hex digits of the SHA-256 of the request's API key."""
    default_tenant: TenantSettings = Field(default_factory=TenantSettings)
    """Weight and limit of every tenant not listed."""
    rate_window_s: float = Field(default=Thresholds().rate_window_s, gt=0)
    """Window over which the router measures the tokens per second it routes (how fast its queue
    drains while the fleet is saturated, which admission predicts waits with)."""
    slo: SloSettings | None = None
    """Targets every request is judged by when it ends (met, missed, refused); none: not judged."""
    metrics_tenants: int = Field(default=20, ge=0)
    """Tenants with their own label in the per-tenant metrics besides those listed in ``tenants``
    (the first ones seen); the others are counted as ``other``, so that clients cannot grow the
    number of series."""
    epp: EppSettings | None = None
    """Run as a gateway's endpoint picker (ext_proc over gRPC) instead of the OpenAI HTTP server."""
    loras: list[LoraSettings] = Field(default_factory=list)
    """LoRA adapters of ``model`` (``spec.model.loras``): requests name one as ``model``; its block
    hashes differ from the base model's and the router prefers workers that hold it."""
    models: list[ServedModel] = Field(default_factory=list)
    """Further models behind this one entry point, each with its own workers (HTTP mode; a gateway
    puts one InferencePool, with its own endpoint picker, per deployment)."""
    max_loras: int = Field(default=AdapterRouting().max_loras, ge=1)
    """LoRA adapters an engine holds at once when its ``/worker_info`` does not say
    (``spec.model.maxLoras``, TensorRT-LLM's ``lora_config.max_loras``)."""
    lora_load_ms: float = Field(default=AdapterRouting().load_ms, ge=0)
    """Predicted time an engine takes to load an adapter it does not hold, ms (what a worker holding
    the adapter saves a request)."""
    adapter_aware: bool = True
    """Prefer workers that hold the request's adapter (off: adapter-blind, for comparison)."""
    share_adapters: bool = True
    """Mirror the adapters peer router replicas' requests load (heard over NATS); off, each replica
    knows only the loads its own requests caused (for comparison)."""
    metrics_adapters: int = Field(default=20, ge=0)
    """Adapters with their own label in the per-adapter metrics (the first ones seen); the others
    are counted as ``other``."""

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"unknown policy {value!r}; known: {', '.join(sorted(POLICIES))}")
        return value

    @model_validator(mode="after")
    def _namespace_from_discovery(self) -> RouterConfig:
        discovery = self.discovery
        if (
            isinstance(discovery, KubernetesDiscovery | InferencePoolDiscovery)
            and "namespace" not in self.model_fields_set
        ):
            self.namespace = discovery.namespace
        return self

    def _served_loras(self) -> list[tuple[str, str, list[LoraSettings]]]:
        """Each base model's field path, name and adapters."""
        return [
            ("", self.model, self.loras),
            *((f"models[{index}].", served.name, served.loras) for index, served in enumerate(self.models)),
        ]

    @model_validator(mode="after")
    def _unique_models(self) -> RouterConfig:
        seen: dict[str, str] = {}
        for prefix, model, loras in self._served_loras():
            where = f"{prefix}name" if prefix else "model"
            if model in seen:
                raise ValueError(f"{where}: name {model!r} is already used by {seen[model]}")
            seen[model] = where
            ids: dict[int, str] = {}
            for index, lora in enumerate(loras):
                where = f"{prefix}loras[{index}]"
                if lora.name in seen:
                    raise ValueError(f"{where}: name {lora.name!r} is already used by {seen[lora.name]}")
                seen[lora.name] = where
                clash = ids.setdefault(lora_int_id(lora.name), lora.name)
                if clash != lora.name:
                    raise ValueError(
                        f"{where}: its lora_int_id (a hash of its name) is that of adapter {clash!r}: "
                        "the engines would take one for the other; rename one of them"
                    )
                if self.engine == "trtllm" and not lora.path:
                    raise ValueError(
                        f"{where}.path: required with engine: trtllm (trtllm-serve reads adapter "
                        f"{lora.name!r} from lora_request.lora_path)"
                    )
        if self.nats_url:
            for index, served in enumerate(self.models):
                if served.deployment is None:
                    raise ValueError(
                        f"models[{index}].deployment: required with nats_url: its engines publish KV "
                        "events on their deployment's subject"
                    )
        if self.models and self.epp is not None:
            raise ValueError(
                "models: an endpoint picker serves one InferencePool; put one pool (and picker) per "
                "deployment behind the gateway instead"
            )
        return self

    def catalog(self) -> ModelCatalog:
        """The models and adapters requests may name."""
        return ModelCatalog(
            {
                model: [Adapter(name=lora.name, base=model, path=lora.path) for lora in loras]
                for _, model, loras in self._served_loras()
            }
        )

    def adapter_routing(self) -> AdapterRouting:
        """How adapters weigh in worker choice."""
        return AdapterRouting(
            max_loras=self.max_loras,
            load_ms=self.lora_load_ms,
            aware=self.adapter_aware,
            shared=self.share_adapters,
        )

    @model_validator(mode="after")
    def _engine_needs(self) -> RouterConfig:
        if self.engine == "mock":
            if self.tokenizer is not None:
                raise ValueError(
                    "tokenizer: mocked engines tokenize with copse's byte tokenizer; "
                    "a model tokenizer is for engine: trtllm"
                )
            return self
        if self.tokenizer is None:
            raise ValueError(
                "tokenizer: required with engine: trtllm; text and chat prompts must be tokenized as "
                "trtllm-serve does, or the router's block hashes never match the engines' KV events "
                "(the operator sets it from spec.router.tokenizer)"
            )
        if self.kv_capacity_tokens is None and self.perf_profile is None:
            raise ValueError(
                "kv_capacity_tokens: required with engine: trtllm unless perf_profile gives it; "
                "busy thresholds and the latency model need the engines' real KV cache size "
                "(the operator sets it from spec.router.kvCapacityTokens)"
            )
        return self

    def selection(self) -> SelectionSettings:
        """The cost-function settings."""
        offload = KvOffload(host_gbps=self.kv_offload.host_gbps, disk_gbps=self.kv_offload.disk_gbps)
        host_ms, disk_ms = offload.block_ms(block_bytes=self.block_size * self.kv_transfer.kv_bytes_per_token)
        return SelectionSettings(
            block_size=self.block_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            temperature=self.temperature,
            objective=self.objective,
            decode_weight=self.decode_weight,
            host_block_ms=host_ms,
            disk_block_ms=disk_ms,
        )

    def classes(self) -> Classes:
        """Objectives and tenant weights."""
        return Classes(
            objectives={name: settings.objective(name) for name, settings in self.objectives.items()},
            default=self.default_objective.objective(""),
            weights={name: tenant.weight for name, tenant in self.tenants.items()},
            default_weight=self.default_tenant.weight,
        )

    def rate_limits(self) -> TenantLimits | None:
        """Per-tenant rate limits; ``None`` when no tenant is limited."""
        limited = {name: t.tokens_per_minute for name, t in self.tenants.items() if t.tokens_per_minute}
        default = self.default_tenant.tokens_per_minute
        if not limited and default is None:
            return None
        return TenantLimits(tokens_per_minute=limited, default_tokens_per_minute=default)

    def thresholds(self) -> Thresholds:
        """Busy thresholds and queue bound."""
        return Thresholds(
            busy_prefill_tokens=self.busy_prefill_tokens,
            contended_prefill_tokens=self.contended_prefill_tokens or self.max_num_batched_tokens,
            busy_kv_fraction=self.busy_kv_fraction,
            queue_size=self.queue_size,
            rate_window_s=self.rate_window_s,
            peer_queue_max_age_s=self.peer_queue_max_age_s,
        )


def _describe(exc: ValidationError, *, source: str) -> str:
    parts = []
    for error in exc.errors():
        message = str(error["msg"]).removeprefix("Value error, ")
        if not error["loc"]:  # a cross-field rule: its message names the fields
            parts.append(f"{source}: {message}")
            continue
        where = ".".join(str(part) for part in error["loc"])
        parts.append(f"{source}: {where}: {message} (got {error.get('input')!r})")
    return "\n".join(parts)


def parse_config(raw: object, *, source: str) -> RouterConfig:
    """Validate a mapping; ``source`` names it in errors. Raises :class:`ConfigError`."""
    try:
        return RouterConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source=source)) from exc


def read_config(path: str | Path) -> dict[str, Any]:
    """The settings in a YAML (or JSON) router config, not yet validated (the command line
    overrides some before :func:`parse_config`). Raises :class:`ConfigError`."""
    return read_yaml_mapping(Path(path), what="router settings", error=ConfigError)


def load_config(path: str | Path) -> RouterConfig:
    """Read and validate a YAML (or JSON) router config. Raises :class:`ConfigError`."""
    return parse_config(read_config(path), source=str(path))
