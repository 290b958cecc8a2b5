"""Realistic fake Nodes (and GPU-holding Pods) for tests, benchmarks, the demo and kwok clusters.

GPU nodes look like GB200 NVL72 compute trays with GPU Feature Discovery labels: one rack is
one NVLink domain (``nvidia.com/gpu.clique = <ClusterUUID>.<CliqueID>``), ``trays_per_rack``
trays of ``gpus_per_tray`` GPUs, racks grouped into blocks of a SuperPOD scalable unit (8
racks). Every node carries ``kwok.x-k8s.io/node: fake`` because kwok manages only those.
Output is deterministic: the same arguments give the same objects.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from copse.topology.labels import (
    CLIQUE_LABEL,
    GPU_COUNT_LABEL,
    GPU_RESOURCE,
    HOSTNAME_LABEL,
    PRODUCT_LABEL,
    SPINE_LABEL,
    UNSCHEDULABLE_TAINT,
    ZONE_LABEL,
)

FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node"
FAKE_NODE_VALUE = "fake"
NODE_POOL_LABEL = "copse.dev/node-pool"
"""``gpu`` or ``cpu``: lets charts and tests pin pods to a pool with a nodeSelector."""
RACKS_PER_BLOCK = 8
"""A GB200 SuperPOD scalable unit is 8 NVL72 racks behind one spine group."""
NOT_READY_TAINT = "node.kubernetes.io/not-ready"

_NAMESPACE = uuid.UUID("5f0c6b1e-3d52-4c55-9a43-2f7e3f0c0c0a")
_GB200_TRAY = {"cpu": "144", "memory": "884Gi", "pods": "110", "ephemeral-storage": "3576Gi"}
"""Two Grace CPUs (2 x 72 cores) and 2 x 480 GB LPDDR5X per compute tray, less system reserve."""
_GB200_GPU_MEMORY_MIB = "189471"
_CPU_NODE = {"cpu": "32", "memory": "128Gi", "pods": "110", "ephemeral-storage": "500Gi"}


def rack_uuid(rack: int) -> str:
    """The ClusterUUID Fabric Manager would report for fake rack ``rack``."""
    return str(uuid.uuid5(_NAMESPACE, f"rack-{rack}"))


def _positions(racks: int, trays: int, *, count: int, from_top: bool) -> list[tuple[int, int]]:
    """``count`` trays spread over racks: one per rack before a second one in any rack."""
    order = range(trays - 1, -1, -1) if from_top else range(trays)
    return [(rack, tray) for tray in order for rack in range(racks)][:count]


def gpu_nodes(
    *,
    racks: int,
    trays_per_rack: int = 18,
    gpus_per_tray: int = 4,
    cordoned: int = 0,
    not_ready: int = 0,
    product: str = "NVIDIA-GB200",
    cliques_per_rack: int = 1,
    racks_per_block: int = RACKS_PER_BLOCK,
    zone: str = "zone-a",
    prefix: str = "gb200",
) -> list[dict[str, Any]]:
    """GB200-style trays named ``<prefix>-r<rack>-t<tray>``.

    ``cordoned`` trays (taken from the top tray of each rack down, spread over racks) are
    cordoned as ``kubectl cordon`` does; ``not_ready`` trays (from the bottom up) report
    Ready=False. ``cliques_per_rack`` > 1 splits each rack's NVLink fabric into partitions
    (an x72 run as 2 x36).
    """
    for name, value, low in (
        ("racks", racks, 0),
        ("trays per rack", trays_per_rack, 1),
        ("GPUs per tray", gpus_per_tray, 1),
        ("cordoned", cordoned, 0),
        ("not ready", not_ready, 0),
        ("cliques per rack", cliques_per_rack, 1),
        ("racks per block", racks_per_block, 1),
    ):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    total = racks * trays_per_rack
    if cordoned + not_ready > total:
        raise ValueError(
            f"cannot cordon {cordoned} and mark {not_ready} NotReady out of {total} trays "
            f"({racks} racks x {trays_per_rack} trays)"
        )
    if cliques_per_rack > trays_per_rack:
        raise ValueError(f"cliques per rack ({cliques_per_rack}) exceeds trays per rack ({trays_per_rack})")
    cordon = set(_positions(racks, trays_per_rack, count=cordoned, from_top=True))
    unready_candidates = [
        p for p in _positions(racks, trays_per_rack, count=total, from_top=False) if p not in cordon
    ]
    unready = set(unready_candidates[:not_ready])
    nodes = []
    for rack in range(racks):
        cluster_uuid = rack_uuid(rack)
        for tray in range(trays_per_rack):
            clique = tray * cliques_per_rack // trays_per_rack
            nodes.append(
                gpu_node(
                    f"{prefix}-r{rack:03d}-t{tray:02d}",
                    clique=f"{cluster_uuid}.{clique}",
                    block=f"block-{rack // racks_per_block:02d}",
                    zone=zone,
                    product=product,
                    gpus=gpus_per_tray,
                    cordoned=(rack, tray) in cordon,
                    ready=(rack, tray) not in unready,
                )
            )
    return nodes


def gpu_node(
    name: str,
    *,
    gpus: int = 4,
    clique: str | None = None,
    block: str | None = None,
    zone: str | None = "zone-a",
    product: str | None = "NVIDIA-GB200",
    cordoned: bool = False,
    ready: bool = True,
    taints: Sequence[Mapping[str, str]] = (),
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """One GB200-style tray; labels that are None are left out (a node GFD has not labelled)."""
    resources = {**_GB200_TRAY, GPU_RESOURCE: str(gpus)}
    spec: dict[str, Any] = {}
    all_taints = [dict(taint) for taint in taints]
    if cordoned:
        spec["unschedulable"] = True
        all_taints.append({"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"})
    if not ready:
        all_taints.append({"key": NOT_READY_TAINT, "effect": "NoSchedule"})
    if all_taints:
        spec["taints"] = all_taints
    node_labels = {
        HOSTNAME_LABEL: name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "arm64",
        "node.kubernetes.io/instance-type": "gb200-nvl72-tray",
        NODE_POOL_LABEL: "gpu",
        "type": "kwok",
        "nvidia.com/gpu.present": "true",
        GPU_COUNT_LABEL: str(gpus),
        "nvidia.com/gpu.memory": _GB200_GPU_MEMORY_MIB,
        "nvidia.com/gpu.family": "blackwell",
        "nvidia.com/gpu.compute.major": "10",
        "nvidia.com/gpu.compute.minor": "0",
    }
    for key, value in (
        (ZONE_LABEL, zone),
        (SPINE_LABEL, block),
        (PRODUCT_LABEL, product),
        (CLIQUE_LABEL, clique),
    ):
        if value is not None:
            node_labels[key] = value
    node_labels.update(labels or {})
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {FAKE_NODE_ANNOTATION: FAKE_NODE_VALUE},
            "labels": node_labels,
        },
        "spec": spec,
        "status": _status(resources, ready=ready, architecture="arm64"),
    }


def _status(resources: Mapping[str, str], *, ready: bool, architecture: str) -> dict[str, Any]:
    pressure = [
        {"type": kind, "status": "False", "reason": f"KubeletHas{reason}"}
        for kind, reason in (
            ("MemoryPressure", "SufficientMemory"),
            ("DiskPressure", "NoDiskPressure"),
            ("PIDPressure", "SufficientPID"),
        )
    ]
    readiness = (
        {"type": "Ready", "status": "True", "reason": "KubeletReady"}
        if ready
        else {"type": "Ready", "status": "False", "reason": "KubeletNotReady"}
    )
    return {
        "capacity": dict(resources),
        "allocatable": dict(resources),
        "conditions": [*pressure, readiness],
        "nodeInfo": {"architecture": architecture, "operatingSystem": "linux", "kubeletVersion": "fake"},
    }


def cpu_nodes(count: int, *, prefix: str = "cpu") -> list[dict[str, Any]]:
    """``count`` CPU-only nodes ``<prefix>-<i>`` for the router, operator and other non-GPU pods."""
    if count < 0:
        raise ValueError(f"CPU node count must be >= 0, got {count}")
    nodes = []
    for index in range(count):
        name = f"{prefix}-{index}"
        nodes.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {FAKE_NODE_ANNOTATION: FAKE_NODE_VALUE},
                    "labels": {
                        HOSTNAME_LABEL: name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        "type": "kwok",
                        NODE_POOL_LABEL: "cpu",
                    },
                },
                "spec": {},
                "status": _status(_CPU_NODE, ready=True, architecture="amd64"),
            }
        )
    return nodes


def node_list(nodes: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """A ``NodeList`` as ``kubectl get nodes -o yaml`` prints it (items keep apiVersion/kind)."""
    return {"apiVersion": "v1", "kind": "NodeList", "metadata": {}, "items": [dict(n) for n in nodes]}


def busy_pods(
    nodes: Sequence[Mapping[str, Any]], *, fraction: float, seed: int, namespace: str = "other"
) -> list[dict[str, Any]]:
    """Running pods of some other workload holding GPUs on about ``fraction`` of the GPU nodes.

    Each chosen node loses between one GPU and all of them, so the cluster has the partly
    used trays a real one has.
    """
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    rng = random.Random(seed)
    pods = []
    for node in nodes:
        gpus = int(str(node.get("status", {}).get("allocatable", {}).get(GPU_RESOURCE, "0")))
        if gpus == 0 or rng.random() >= fraction:
            continue
        name = node["metadata"]["name"]
        taken = str(rng.randint(1, gpus))
        pods.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"busy-{name}", "namespace": namespace},
                "spec": {
                    "nodeName": name,
                    "containers": [
                        {
                            "name": "main",
                            "image": "registry.k8s.io/pause:3.10",
                            "resources": {"requests": {GPU_RESOURCE: taken}, "limits": {GPU_RESOURCE: taken}},
                        }
                    ],
                },
                "status": {"phase": "Running"},
            }
        )
    return pods
