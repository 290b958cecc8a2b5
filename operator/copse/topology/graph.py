"""The cluster as a tree of zones, blocks, racks, NVLink domains and nodes (a networkx DiGraph).

Built from Node objects as the API returns them, minus the GPUs that bound, non-terminated pods
request. Two GPUs' link tier is the kind of their lowest common ancestor in the tree. Labels
that disagree with each other are resolved in favour of the tree (a domain lives in one rack,
a rack in one block, a block in one zone) and reported in ``warnings``; missing labels drop a
level, so such nodes only share the slower tiers.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import networkx as nx

from copse.topology import kube
from copse.topology.kube import NODE_CONDITION_TAINTS, Taint, Toleration
from copse.topology.labels import CLIQUE_LABEL, UNSCHEDULABLE_TAINT, LabelKeys, clique_rack, first_label
from copse.topology.links import Link, LinkTable, LinkTier

ROOT = ("cluster", "")
"""The tree's root vertex; every zone (or, without zones, every lower level) hangs below it."""

_LEVEL_TIER = {
    "node": LinkTier.NODE,
    "domain": LinkTier.DOMAIN,
    "rack": LinkTier.RACK,
    "block": LinkTier.BLOCK,
    "zone": LinkTier.BEYOND,
    "cluster": LinkTier.BEYOND,
}


class TopologyError(ValueError):
    """A node or pod list cannot be read at all (a node without a name, a duplicate name)."""


@dataclass(frozen=True, kw_only=True, eq=False)
class GpuNode:
    """One Kubernetes node as placement sees it; rack/block/zone are the tree's resolved values."""

    name: str
    gpus: int
    """Allocatable GPUs."""
    used: int
    """GPUs requested by bound, non-terminated pods."""
    product: str | None
    domain: str
    """NVLink domain id: the clique, or the node's own name when it has no clique label."""
    clique: str | None
    rack: str | None
    block: str | None
    zone: str | None
    ready: bool
    not_ready_since: float | None = None
    """When it stopped being Ready or reachable (s since the epoch); None while it is fine."""
    cordoned: bool
    taints: tuple[Taint, ...]
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def free(self) -> int:
        return max(self.gpus - self.used, 0)

    def blockers(
        self, tolerations: Sequence[Toleration] = (), node_selector: Mapping[str, str] | None = None
    ) -> tuple[str, ...]:
        """Why a pod with these tolerations and node selector cannot land here (empty: it can)."""
        reasons: list[str] = []
        if not self.ready:
            reasons.append("NotReady")
        if self.cordoned and not kube.tolerated(Taint(key=UNSCHEDULABLE_TAINT), tolerations):
            reasons.append("cordoned")
        for taint in self.taints:
            if (taint.key == UNSCHEDULABLE_TAINT and self.cordoned) or (
                taint.key in NODE_CONDITION_TAINTS and not self.ready
            ):
                continue  # the condition behind the taint is reported already
            if taint.effect in kube.BLOCKING_EFFECTS and not kube.tolerated(taint, tolerations):
                reasons.append(f"taint {taint}")
        for key, value in (node_selector or {}).items():
            if self.labels.get(key) != value:
                reasons.append(f"nodeSelector {key}={value}")
        return tuple(reasons)


@dataclass(frozen=True, kw_only=True)
class Domain:
    """An NVLink domain (GFD clique): GPUs that reach each other over NVLink."""

    id: str
    clique: str | None
    rack: str | None
    block: str | None
    zone: str | None
    nodes: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class _Raw:
    name: str
    labels: dict[str, str]
    clique: str | None
    rack: str | None
    block: str | None
    zone: str | None
    node: Mapping[str, Any]


class Topology:
    """Nodes, NVLink domains and the tree above them; immutable once built."""

    def __init__(
        self,
        *,
        nodes: Mapping[str, GpuNode],
        domains: Mapping[str, Domain],
        graph: nx.DiGraph,
        links: LinkTable,
        label_keys: LabelKeys,
        warnings: Sequence[str],
    ) -> None:
        self.nodes: Mapping[str, GpuNode] = MappingProxyType(dict(nodes))
        self.domains: Mapping[str, Domain] = MappingProxyType(dict(domains))
        self.graph = graph
        self.links = links
        self.label_keys = label_keys
        self.warnings: tuple[str, ...] = tuple(warnings)

    @property
    def gpu_nodes(self) -> list[GpuNode]:
        """Nodes with at least one allocatable GPU, in name order."""
        return [node for node in self.nodes.values() if node.gpus > 0]

    def tier(self, a: str, b: str) -> LinkTier:
        """The link tier between GPUs on nodes ``a`` and ``b``."""
        if a == b:
            return LinkTier.NODE
        x, y = self.nodes[a], self.nodes[b]
        if x.domain == y.domain:
            return LinkTier.DOMAIN
        if x.rack is not None and x.rack == y.rack:
            return LinkTier.RACK
        if x.block is not None and x.block == y.block:
            return LinkTier.BLOCK
        return LinkTier.BEYOND

    def link(self, a: str, b: str) -> Link:
        return self.links[self.tier(a, b)]

    def lca_tier(self, a: str, b: str) -> LinkTier:
        """The same answer as :meth:`tier`, read off the graph (slower; for checks and tools)."""
        vertex = nx.lowest_common_ancestor(self.graph, ("node", a), ("node", b))
        return _LEVEL_TIER[vertex[0]]


def gpu_usage(pods: Iterable[Mapping[str, Any]], *, resource: str) -> dict[str, int]:
    """GPUs requested per node by bound, non-terminated pods."""
    used: dict[str, int] = {}
    for pod in pods:
        node = kube.pod_node(pod)
        if node is None:
            continue
        gpus = kube.pod_request(pod, resource)
        if gpus:
            used[node] = used.get(node, 0) + gpus
    return used


def _first_wins(
    *, owner: str, level: str, key: str, value: str | None, seen: dict[str, str | None], warnings: list[str]
) -> str | None:
    """The parent a vertex got first; a later, different claim is reported and ignored."""
    if key not in seen:
        seen[key] = value
    elif value is not None and seen[key] != value:
        warnings.append(f"{owner}: {level} {value!r} disagrees with {seen[key]!r} seen first; using that")
    return seen[key]


def build_topology(
    nodes: Iterable[Mapping[str, Any]],
    *,
    pods: Iterable[Mapping[str, Any]] = (),
    label_keys: LabelKeys | None = None,
    links: LinkTable | None = None,
) -> Topology:
    """The topology of ``nodes`` (Node dicts), minus the GPUs ``pods`` (Pod dicts) hold.

    Pass only pods that are not part of what is being placed (for the operator: every pod
    except those of the deployment being reconciled).
    """
    keys = label_keys or LabelKeys()
    warnings: list[str] = []
    raws: list[_Raw] = []
    names: set[str] = set()
    for index, node in enumerate(nodes):
        if not isinstance(node, dict):
            raise TopologyError(f"nodes[{index}]: expected a Node object, got {type(node).__name__}")
        kind = node.get("kind")
        if kind not in (None, "Node"):
            raise TopologyError(f"nodes[{index}]: expected kind Node, got {kind!r}")
        name = kube.metadata(node).get("name")
        if not isinstance(name, str) or not name:
            raise TopologyError(f"nodes[{index}]: metadata.name is missing")
        if name in names:
            raise TopologyError(f"nodes[{index}]: duplicate node name {name!r}")
        names.add(name)
        node_labels = kube.labels(node)
        clique = first_label(node_labels, keys.domain)
        rack = first_label(node_labels, keys.rack)
        gfd_clique = node_labels.get(CLIQUE_LABEL)
        if rack is None and keys.rack_from_clique and gfd_clique:
            rack = clique_rack(gfd_clique)
        raws.append(
            _Raw(
                name=name,
                labels=node_labels,
                clique=clique,
                rack=rack,
                block=first_label(node_labels, keys.block),
                zone=first_label(node_labels, keys.zone),
                node=node,
            )
        )

    cliques = {raw.clique for raw in raws if raw.clique is not None}
    used = gpu_usage(pods, resource=keys.gpu_resource)
    for node_name in sorted(set(used) - names):
        warnings.append(f"pods on node {node_name!r}, which is not in the node list, were ignored")

    # Resolve the tree top-down from the first claim of each vertex, in node-name order.
    domain_rack: dict[str, str | None] = {}
    rack_block: dict[str, str | None] = {}
    block_zone: dict[str, str | None] = {}
    domain_block: dict[str, str | None] = {}
    domain_zone: dict[str, str | None] = {}
    rack_zone: dict[str, str | None] = {}
    members: dict[str, list[str]] = {}
    resolved: dict[str, tuple[str, str | None, str | None, str | None]] = {}
    for raw in sorted(raws, key=lambda r: r.name):
        if raw.clique is not None:
            domain = raw.clique
        else:
            domain = raw.name if raw.name not in cliques else f"{raw.name}/node"
        members.setdefault(domain, []).append(raw.name)

        claim = functools.partial(_first_wins, owner=raw.name, warnings=warnings)
        rack = claim(level="rack", key=domain, value=raw.rack, seen=domain_rack)
        if rack is not None:
            block = claim(level="block", key=rack, value=raw.block, seen=rack_block)
        else:
            block = claim(level="block", key=domain, value=raw.block, seen=domain_block)
        if block is not None:
            zone = claim(level="zone", key=block, value=raw.zone, seen=block_zone)
        elif rack is not None:
            zone = claim(level="zone", key=rack, value=raw.zone, seen=rack_zone)
        else:
            zone = claim(level="zone", key=domain, value=raw.zone, seen=domain_zone)
        resolved[raw.name] = (domain, rack, block, zone)

    graph = nx.DiGraph()
    graph.add_node(ROOT, kind="cluster")
    gpu_nodes: dict[str, GpuNode] = {}
    domains: dict[str, Domain] = {}
    for raw in sorted(raws, key=lambda r: r.name):
        domain, rack, block, zone = resolved[raw.name]
        gpus = kube.allocatable(raw.node, keys.gpu_resource)
        node_used = used.get(raw.name, 0)
        if node_used > gpus:
            warnings.append(f"node {raw.name}: pods request {node_used} GPUs but only {gpus} are allocatable")
        gpu_node = GpuNode(
            name=raw.name,
            gpus=gpus,
            used=node_used,
            product=first_label(raw.labels, keys.product),
            domain=domain,
            clique=raw.clique,
            rack=rack,
            block=block,
            zone=zone,
            ready=kube.node_ready(raw.node),
            not_ready_since=kube.node_not_ready_since(raw.node),
            cordoned=kube.node_cordoned(raw.node),
            taints=kube.node_taints(raw.node),
            labels=MappingProxyType(raw.labels),
        )
        gpu_nodes[raw.name] = gpu_node
        if domain not in domains:
            domains[domain] = Domain(
                id=domain,
                clique=raw.clique,
                rack=rack,
                block=block,
                zone=zone,
                nodes=tuple(members[domain]),
            )
        parent = ROOT
        for level, value in (("zone", zone), ("block", block), ("rack", rack), ("domain", domain)):
            if value is None:
                continue
            vertex = (level, value)
            if vertex not in graph:
                graph.add_node(vertex, kind=level)
                graph.add_edge(parent, vertex)
            parent = vertex
        graph.add_node(("node", raw.name), kind="node", gpus=gpus, used=node_used, product=gpu_node.product)
        graph.add_edge(parent, ("node", raw.name))
    return Topology(
        nodes=gpu_nodes,
        domains=domains,
        graph=graph,
        links=links or LinkTable(),
        label_keys=keys,
        warnings=warnings,
    )
