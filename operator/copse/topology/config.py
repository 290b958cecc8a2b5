"""Topology settings from a file: which labels to read and what each link tier costs.

labels:                      # optional, see LabelKeys
  rack: [example.com/rack]
  rackFromClique: false
links:                       # optional, per tier: node, domain, rack, block, beyond
  rack: {bandwidthGBps: 100, latencyUs: 2}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from copse.topology.labels import LabelKeys
from copse.topology.links import LinkTable


@dataclass(frozen=True, kw_only=True)
class TopologyConfig:
    labels: LabelKeys = field(default_factory=LabelKeys)
    """Label keys per level; the defaults cover GFD, topograph and the GKE/AWS/OCI keys."""
    links: LinkTable = field(default_factory=LinkTable)
    """Bandwidth and latency per tier; the defaults describe GB200 NVL72 with 400 Gb/s NICs."""

    @classmethod
    def from_dict(cls, data: Any) -> TopologyConfig:
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ValueError(f"expected an object with 'labels' and/or 'links', got {type(data).__name__}")
        unknown = sorted(set(data) - {"labels", "links"})
        if unknown:
            raise ValueError(f"unknown keys {unknown}; known: labels, links")
        labels, links = data.get("labels") or {}, data.get("links") or {}
        for name, value in (("labels", labels), ("links", links)):
            if not isinstance(value, dict):
                raise ValueError(f"{name}: expected an object, got {value!r}")
        return cls(labels=LabelKeys.from_dict(labels), links=LinkTable.from_dict(links))
