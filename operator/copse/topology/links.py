"""Link tiers between two GPUs and what each tier costs (bandwidth, latency).

The tier is the narrowest level two GPUs share: the same node, the same NVLink domain, the
same rack, the same block, or nothing closer than the data-centre fabric. Defaults describe
GB200 NVL72: NVLink 5 within a domain, 400 Gb/s InfiniBand/RoCE per GPU beyond it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any


class LinkTier(enum.IntEnum):
    """Ordered from the fastest to the slowest link; comparisons mean "closer than"."""

    NODE = 0
    DOMAIN = 1
    RACK = 2
    BLOCK = 3
    BEYOND = 4

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, kw_only=True)
class Link:
    """One tier's per-GPU link."""

    bandwidth_gbps: float
    """Per-GPU bandwidth in GB/s (1e9 bytes/s) in one direction; the bottleneck of a ring."""
    latency_us: float
    """One hop's latency in microseconds; a ring pays it once per step."""

    def __post_init__(self) -> None:
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"bandwidth must be > 0 GB/s, got {self.bandwidth_gbps}")
        if not self.latency_us >= 0:
            raise ValueError(f"latency must be >= 0 us, got {self.latency_us}")

    def transfer_us(self, size_bytes: float) -> float:
        """Time to send ``size_bytes`` once over this link."""
        return self.latency_us + size_bytes / (self.bandwidth_gbps * 1e3)

    def ring_allreduce_us(self, ranks: int, size_bytes: float) -> float:
        """Ring all-reduce of ``size_bytes`` over ``ranks`` GPUs whose slowest link is this one.

        2(n-1) steps, each moving size/n bytes and paying one latency (reduce-scatter, then
        all-gather).
        """
        if ranks <= 1:
            return 0.0
        return 2 * (ranks - 1) * (self.latency_us + size_bytes / ranks / (self.bandwidth_gbps * 1e3))


@dataclass(frozen=True, kw_only=True)
class LinkTable:
    """Bandwidth and latency per tier; override any of them from configuration."""

    node: Link = Link(bandwidth_gbps=900.0, latency_us=0.7)
    """NVLink 5 inside a tray: 1.8 TB/s per GPU both ways."""
    domain: Link = Link(bandwidth_gbps=900.0, latency_us=1.0)
    """NVLink 5 through the NVLink switch trays of an NVL72 rack: same bandwidth, one more hop."""
    rack: Link = Link(bandwidth_gbps=50.0, latency_us=3.0)
    """Different NVLink partitions in one rack: 400 Gb/s NIC per GPU through the leaf switch."""
    block: Link = Link(bandwidth_gbps=50.0, latency_us=5.0)
    """Across racks of one non-blocking scalable unit: same NICs, two more switch hops."""
    beyond: Link = Link(bandwidth_gbps=25.0, latency_us=10.0)
    """Across blocks or unknown locations: an oversubscribed (2:1) spine/core tier."""

    def __getitem__(self, tier: LinkTier) -> Link:
        link: Link = getattr(self, tier.label)
        return link

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LinkTable:
        """``{"rack": {"bandwidthGBps": 100, "latencyUs": 2}}``; unspecified values keep defaults."""
        table = cls()
        names = {tier.label for tier in LinkTier}
        for name, override in data.items():
            if name not in names:
                raise ValueError(f"links: unknown tier {name!r}; tiers: {sorted(names)}")
            if not isinstance(override, dict):
                raise ValueError(f"links.{name}: expected an object, got {override!r}")
            unknown = sorted(set(override) - {"bandwidthGBps", "latencyUs"})
            if unknown:
                raise ValueError(f"links.{name}: unknown keys {unknown}; known: bandwidthGBps, latencyUs")
            current = table[LinkTier[name.upper()]]
            try:
                link = Link(
                    bandwidth_gbps=float(override.get("bandwidthGBps", current.bandwidth_gbps)),
                    latency_us=float(override.get("latencyUs", current.latency_us)),
                )
            except (TypeError, ValueError) as exc:
                raise ValueError(f"links.{name}: {exc}") from exc
            table = replace(table, **{name: link})
        return table
