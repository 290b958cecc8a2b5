"""Which node labels say where a node sits: NVLink domain, rack, block, zone, GPU product.

Each level lists several keys, first match wins, so one configuration covers GPU Feature
Discovery, topograph and the cloud providers' own labels (see ``shared/research/grove.md`` §4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
CLIQUE_LABEL = "nvidia.com/gpu.clique"
PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
ZONE_LABEL = "topology.kubernetes.io/zone"
HOSTNAME_LABEL = "kubernetes.io/hostname"
SPINE_LABEL = "network.topology.nvidia.com/spine"
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"


@dataclass(frozen=True, kw_only=True)
class LabelKeys:
    """Label keys per topology level; the first key a node carries decides its value."""

    domain: tuple[str, ...] = (
        CLIQUE_LABEL,
        "network.topology.nvidia.com/accelerator",
        "accelerator.topograph.run/domain",
        "topology.k8s.aws/ultraserver-id",
    )
    """NVLink domain (partition). GFD's clique first: it is the finest and most widespread."""
    rack: tuple[str, ...] = (
        "oci.oraclecloud.com/host.rack_id",
        "cloud.provider.com/topology-rack",
        "kubernetes.io/rack",
        "network.topology.nvidia.com/leaf",
        "topology.k8s.aws/network-node-layer-3",
        "fabric.topograph.run/tier-1",
    )
    """Rack or top-of-rack switch; explicit rack ids before leaf-switch ids."""
    rack_from_clique: bool = True
    """Without a rack label, the clique's ``<ClusterUUID>`` prefix names the rack (one NVL72 rack)."""
    block: tuple[str, ...] = (
        SPINE_LABEL,
        "cloud.google.com/gce-topology-block",
        "topology.k8s.aws/network-node-layer-2",
        "oci.oraclecloud.com/host.network_block_id",
        "fabric.topograph.run/tier-2",
        "cloud.provider.com/topology-block",
        "kubernetes.io/block",
    )
    """Group of racks behind one aggregation tier (a SuperPOD scalable unit, a GKE block)."""
    zone: tuple[str, ...] = (ZONE_LABEL, "kubernetes.io/zone")
    """Availability zone; only used to group racks, zones never share a faster tier."""
    product: tuple[str, ...] = (PRODUCT_LABEL,)
    """GPU model; groups never mix products."""
    gpu_resource: str = GPU_RESOURCE
    """Extended resource counting a node's GPUs (allocatable) and a pod's GPU requests."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LabelKeys:
        """Keys from configuration: ``{"rack": ["my.org/rack"], "rackFromClique": false, ...}``."""
        known = {
            "domain": "domain",
            "rack": "rack",
            "rackFromClique": "rack_from_clique",
            "block": "block",
            "zone": "zone",
            "product": "product",
            "gpuResource": "gpu_resource",
        }
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"labels: unknown keys {unknown}; known: {sorted(known)}")
        values: dict[str, Any] = {}
        for name, attribute in known.items():
            if name not in data:
                continue
            value = data[name]
            if attribute == "rack_from_clique":
                if not isinstance(value, bool):
                    raise ValueError(f"labels.{name}: expected true or false, got {value!r}")
                values[attribute] = value
            elif attribute == "gpu_resource":
                if not isinstance(value, str) or not value:
                    raise ValueError(f"labels.{name}: expected a resource name, got {value!r}")
                values[attribute] = value
            else:
                if isinstance(value, str):
                    value = [value]
                if not isinstance(value, list) or not all(isinstance(key, str) and key for key in value):
                    raise ValueError(f"labels.{name}: expected a list of label keys, got {value!r}")
                values[attribute] = tuple(value)
        return cls(**values)


def first_label(labels: dict[str, str], keys: tuple[str, ...]) -> str | None:
    """The value of the first key present with a non-empty value."""
    for key in keys:
        value = labels.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def clique_rack(clique: str) -> str:
    """The ``<ClusterUUID>`` of a ``<ClusterUUID>.<CliqueID>`` clique (the whole value if no dot)."""
    head, dot, _ = clique.rpartition(".")
    return head if dot and head else clique
