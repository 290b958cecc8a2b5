"""KV cache tiers below the GPU: how many blocks an engine keeps there, and what bringing them back
costs. One description serves the mocker (its host and disk LRU pools and the onboarding time it
adds to a step), the router (the onboarding time it adds to a worker's predicted time to first
token) and the planner (the hit rate the fleet reaches with the offload tier).

Tiers are numbered as TensorRT-LLM numbers its cache levels in KV events (``cache_level``: 0 the
GPU, the primary pool; 1 host memory, the secondary pool) plus 2 for a disk tier, which
TensorRT-LLM's own KV cache manager does not have (Dynamo's KVBM adds one: its G3).

Onboarding a block moves its KV bytes (``block_size x kv_bytes_per_token``) from the tier into GPU
memory at the tier's bandwidth, before the prefill that reuses it continues.
"""

from __future__ import annotations

import dataclasses

GPU, HOST, DISK = 0, 1, 2
TIER_NAMES = ("gpu", "host", "disk")
"""Tier number -> name (metric labels, logs)."""


@dataclasses.dataclass(frozen=True, slots=True)
class KvOffload:
    """The offload tiers of one engine (all zero: none, the GPU cache alone)."""

    host_bytes: int = 0
    """Host memory for KV blocks evicted from the GPU (TensorRT-LLM's ``kv_cache_config.host_cache_size``)."""
    disk_bytes: int = 0
    """Disk for KV blocks evicted from host memory (mocked engines only: TensorRT-LLM has no disk tier)."""
    host_gbps: float = 50.0
    """Host-to-GPU copy bandwidth, GB/s: what PCIe Gen5 x16 (64 GB/s each way) gives in practice.
    A GB200's NVLink-C2C between Grace and Blackwell carries 450 GB/s each way: set it there."""
    disk_gbps: float = 7.0
    """Disk-to-GPU bandwidth, GB/s: one NVMe Gen4 SSD's sequential read (GPUDirect Storage)."""

    def __post_init__(self) -> None:
        for name in ("host_bytes", "disk_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must not be negative")
        for name in ("host_gbps", "disk_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.disk_bytes and not self.host_bytes:
            raise ValueError("a disk tier needs a host tier: blocks reach disk from host memory")

    @property
    def enabled(self) -> bool:
        """Whether the engine keeps any block below the GPU."""
        return bool(self.host_bytes or self.disk_bytes)

    def blocks(self, *, block_bytes: int) -> tuple[int, int]:
        """Blocks of ``block_bytes`` the host and the disk tier hold."""
        if block_bytes < 1:
            raise ValueError(f"block_bytes={block_bytes} must be at least 1")
        return self.host_bytes // block_bytes, self.disk_bytes // block_bytes

    def block_ms(self, *, block_bytes: float) -> tuple[float, float]:
        """Time to onboard one block of ``block_bytes`` from the host and from disk, ms."""
        return (
            block_bytes / (self.host_gbps * 1e9) * 1000.0,
            block_bytes / (self.disk_gbps * 1e9) * 1000.0,
        )

    def onboard_ms(self, *, host_blocks: int, disk_blocks: int, block_bytes: float) -> float:
        """Time to onboard that many blocks from each tier, ms."""
        host_ms, disk_ms = self.block_ms(block_bytes=block_bytes)
        return host_blocks * host_ms + disk_blocks * disk_ms
