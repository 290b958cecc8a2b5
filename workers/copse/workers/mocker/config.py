"""Settings of one mocked engine."""

from __future__ import annotations

import dataclasses
from typing import Literal

from copse.workers.mocker.adapters import AdapterSettings
from copse.workers.moe import MoeConfig
from copse.workers.perf import KvOffload

Role = Literal["aggregated", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("aggregated", "prefill", "decode")


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """How one mocked engine schedules and what it can hold (defaults follow vLLM v1 / TensorRT-LLM)."""

    block_size: int = 32
    """Tokens per KV block (TensorRT-LLM's default ``tokens_per_block``); routers must hash with it."""
    num_blocks: int | None = None
    """KV blocks of the engine; ``None`` takes the perf model's ``kv_capacity_tokens // block_size``."""
    max_num_seqs: int = 256
    """Most sequences running at once (vLLM's default)."""
    max_num_batched_tokens: int = 8192
    """Token budget of one step, prefill chunks plus decodes (vLLM's default)."""
    enable_chunked_prefill: bool = True
    """Split prompts larger than the remaining budget across steps; off, such a prompt waits."""
    max_model_len: int = 131072
    """Longest prompt plus output accepted; longer requests are refused (HTTP 400)."""
    max_waiting: int = 4096
    """Bound on queued requests; beyond it new requests are refused (HTTP 503), so overload is visible."""
    speedup_ratio: float = 1.0
    """Divides every step time (run a fast model, or simulate faster hardware)."""
    decode_speedup_ratio: float = 1.0
    """Further divides decode step time only."""
    role: Role = "aggregated"
    """aggregated: whole requests; prefill: context-only requests; decode: generation-only requests."""
    kv_bytes_per_token: int = 131072
    """KV bytes per token moved from a prefill to a decode engine (Llama-3-8B, fp16: 32 layers x 8 KV heads
    x 128 dims x 2 tensors x 2 bytes)."""
    kv_transfer_bandwidth_gbps: float = 64.0
    """GB/s of a prefill-to-decode KV transfer (Dynamo's mocker default); delay = bytes / bandwidth."""
    seed: int = 0
    """Seeds generated token ids and step-time noise. An id depends on the seed, its position in the
    sequence and the sequence's first token only (like greedy decoding: not on the batch or the
    engine), so runs are reproducible and a sequence continued on another engine of the same seed
    goes on identically."""
    moe: MoeConfig | None = None
    """An expert-parallel Mixture-of-Experts engine: its all-to-all and slowest rank add to every step."""
    step_time_cv: float = 0.0
    """Coefficient of variation of step times: each step's time is multiplied by a log-normal factor
    of mean 1 (kernels, clocks and host jitter make real steps vary; 0: exactly the perf model)."""
    host_cache_bytes: int = 0
    """Host memory for KV blocks evicted from the GPU (TensorRT-LLM's ``kv_cache_config.host_cache_size``);
    0: evicted blocks leave the cache."""
    disk_cache_bytes: int = 0
    """Disk for KV blocks evicted from host memory (Dynamo KVBM's disk tier; TensorRT-LLM has none)."""
    host_bandwidth_gbps: float = KvOffload().host_gbps
    """GB/s at which blocks come back from host memory (the onboarding time a prefix hit there costs)."""
    disk_bandwidth_gbps: float = KvOffload().disk_gbps
    """GB/s at which blocks come back from disk."""
    adapters: AdapterSettings = dataclasses.field(default_factory=AdapterSettings)
    """LoRA adapters held at once and the time to load one (requests naming an adapter wait for it)."""

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks={self.num_blocks} must be at least 1")
        for name in ("speedup_ratio", "decode_speedup_ratio", "kv_transfer_bandwidth_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if not 0.0 <= self.step_time_cv < 10.0:
            raise ValueError(f"step_time_cv={self.step_time_cv} must lie in [0, 10)")
        if self.offload.enabled and not self.kv_bytes_per_token:
            raise ValueError("offload tiers need kv_bytes_per_token (the size of the blocks they hold)")
        if self.kv_bytes_per_token < 0:
            raise ValueError(f"kv_bytes_per_token={self.kv_bytes_per_token} must not be negative")
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r} must be one of {', '.join(ROLES)}")

    @property
    def offload(self) -> KvOffload:
        """The tiers below the GPU (host memory, disk) and their bandwidths."""
        return KvOffload(
            host_bytes=self.host_cache_bytes,
            disk_bytes=self.disk_cache_bytes,
            host_gbps=self.host_bandwidth_gbps,
            disk_gbps=self.disk_bandwidth_gbps,
        )

    @property
    def block_bytes(self) -> int:
        """KV bytes of one block."""
        return self.block_size * self.kv_bytes_per_token
