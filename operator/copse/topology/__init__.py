"""The cluster's GPU topology: nodes, NVLink domains, racks, blocks and the link tiers between them."""

from copse.topology.config import TopologyConfig
from copse.topology.graph import Domain, GpuNode, Topology, TopologyError, build_topology, gpu_usage
from copse.topology.kube import Taint, Toleration
from copse.topology.labels import LabelKeys
from copse.topology.links import Link, LinkTable, LinkTier

__all__ = [
    "Domain",
    "GpuNode",
    "LabelKeys",
    "Link",
    "LinkTable",
    "LinkTier",
    "Taint",
    "Toleration",
    "Topology",
    "TopologyConfig",
    "TopologyError",
    "build_topology",
    "gpu_usage",
]
