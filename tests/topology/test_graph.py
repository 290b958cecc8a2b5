"""The topology graph: domains, racks, tiers, exclusions, GPU usage and odd labels."""

from __future__ import annotations

from typing import Any

import pytest

from copse.topology import (
    LabelKeys,
    LinkTable,
    LinkTier,
    Toleration,
    TopologyConfig,
    TopologyError,
    build_topology,
    fake,
)
from copse.topology.kube import Taint


def gpu_pod(node: str | None, gpus: int, *, phase: str = "Running", **resources: Any) -> dict[str, Any]:
    requests = resources.get("requests", {"nvidia.com/gpu": str(gpus)})
    limits = resources.get("limits", {"nvidia.com/gpu": str(gpus)})
    spec: dict[str, Any] = {
        "containers": [{"name": "main", "resources": {"requests": requests, "limits": limits}}]
    }
    if node is not None:
        spec["nodeName"] = node
    if "init" in resources:
        spec["initContainers"] = [
            {"name": "init", "resources": {"requests": {"nvidia.com/gpu": str(resources["init"])}}}
        ]
    return {"kind": "Pod", "metadata": {"name": f"p-{node}-{gpus}"}, "spec": spec, "status": {"phase": phase}}


def test_gb200_racks_are_nvlink_domains_and_blocks_group_racks() -> None:
    topology = build_topology(fake.gpu_nodes(racks=10, trays_per_rack=3))
    assert len(topology.domains) == 10
    assert all(len(domain.nodes) == 3 for domain in topology.domains.values())
    first = "gb200-r000-t00"
    cases = {
        first: LinkTier.NODE,
        "gb200-r000-t02": LinkTier.DOMAIN,
        "gb200-r007-t00": LinkTier.BLOCK,  # racks 0-7 form block-00
        "gb200-r008-t00": LinkTier.BEYOND,
    }
    for other, tier in cases.items():
        assert topology.tier(first, other) is tier
        assert topology.lca_tier(first, other) is tier
    node = topology.nodes[first]
    assert node.gpus == 4
    assert node.product == "NVIDIA-GB200"
    assert node.rack == fake.rack_uuid(0)
    assert node.block == "block-00"
    assert node.zone == "zone-a"


def test_split_cliques_share_the_rack_tier() -> None:
    topology = build_topology(fake.gpu_nodes(racks=1, trays_per_rack=4, cliques_per_rack=2))
    assert len(topology.domains) == 2
    assert topology.tier("gb200-r000-t00", "gb200-r000-t01") is LinkTier.DOMAIN
    assert topology.tier("gb200-r000-t00", "gb200-r000-t03") is LinkTier.RACK


def test_node_without_clique_is_its_own_domain_and_rack_labels_still_count() -> None:
    nodes = [
        fake.gpu_node("a", labels={"kubernetes.io/rack": "r1"}),
        fake.gpu_node("b", labels={"kubernetes.io/rack": "r1"}),
        fake.gpu_node("c"),
    ]
    topology = build_topology(nodes)
    assert topology.nodes["a"].domain == "a"
    assert topology.nodes["a"].clique is None
    assert topology.tier("a", "b") is LinkTier.RACK
    # No rack and no block label: only the weakest tier is shared.
    assert topology.tier("a", "c") is LinkTier.BEYOND
    assert topology.lca_tier("a", "c") is LinkTier.BEYOND


def test_blockers_follow_kubernetes_taint_and_toleration_rules() -> None:
    nodes = [
        fake.gpu_node("ok"),
        fake.gpu_node("down", ready=False),
        fake.gpu_node("cordoned", cordoned=True),
        fake.gpu_node("tainted", taints=[{"key": "gpu", "value": "maint", "effect": "NoSchedule"}]),
        fake.gpu_node("soft", taints=[{"key": "gpu", "value": "x", "effect": "PreferNoSchedule"}]),
    ]
    topology = build_topology(nodes)
    blockers = {name: node.blockers() for name, node in topology.nodes.items()}
    assert blockers == {
        "ok": (),
        "down": ("NotReady",),
        "cordoned": ("cordoned",),
        "tainted": ("taint gpu=maint:NoSchedule",),
        "soft": (),
    }
    tainted = topology.nodes["tainted"]
    assert tainted.blockers([Toleration(key="gpu", operator="Exists")]) == ()
    assert tainted.blockers([Toleration(key="gpu", value="maint", effect="NoSchedule")]) == ()
    assert tainted.blockers([Toleration(key="gpu", value="other")]) != ()
    assert tainted.blockers([Toleration(key="gpu", operator="Exists", effect="NoExecute")]) != ()
    assert tainted.blockers([Toleration(operator="Exists")]) == ()
    cordoned = topology.nodes["cordoned"]
    assert cordoned.blockers([Toleration(key="node.kubernetes.io/unschedulable", operator="Exists")]) == ()
    # NotReady is never tolerated: a gang must not land on a node that is down.
    assert "NotReady" in topology.nodes["down"].blockers([Toleration(operator="Exists")])


def test_node_selector_is_a_blocker() -> None:
    topology = build_topology([fake.gpu_node("a", labels={"pool": "x"})])
    node = topology.nodes["a"]
    assert node.blockers(node_selector={"pool": "x"}) == ()
    assert node.blockers(node_selector={"pool": "y"}) == ("nodeSelector pool=y",)


def test_gpus_held_by_bound_running_pods_are_not_free() -> None:
    nodes = [fake.gpu_node(name) for name in ("a", "b", "c", "d")]
    pods = [
        gpu_pod("a", 1),
        gpu_pod("a", 2),
        gpu_pod("b", 3, phase="Succeeded"),  # finished pods hold nothing
        gpu_pod(None, 4, phase="Pending"),  # not bound yet
        gpu_pod("c", 0, requests={}, limits={"nvidia.com/gpu": "2"}),  # request defaults to limit
        gpu_pod("d", 1, init=3),  # an init container asking more than the app containers
    ]
    topology = build_topology(nodes, pods=pods)
    assert {name: node.free for name, node in topology.nodes.items()} == {"a": 1, "b": 4, "c": 2, "d": 1}


def test_pods_on_unknown_nodes_and_overcommitted_nodes_warn() -> None:
    topology = build_topology([fake.gpu_node("a")], pods=[gpu_pod("ghost", 1), gpu_pod("a", 6)])
    assert topology.nodes["a"].free == 0
    assert any("ghost" in warning for warning in topology.warnings)
    assert any("node a" in warning for warning in topology.warnings)


def test_odd_labels_and_values_degrade_instead_of_failing() -> None:
    odd = fake.gpu_node("odd", clique="no-dot-here")
    odd["status"]["allocatable"]["nvidia.com/gpu"] = "lots"
    odd["metadata"]["labels"]["nvidia.com/gpu.product"] = 7  # not a string
    bare = {"metadata": {"name": "bare"}}  # no labels, no status: a hand-written node
    topology = build_topology([odd, bare])
    assert topology.nodes["odd"].gpus == 0
    assert topology.nodes["odd"].rack == "no-dot-here"
    assert topology.nodes["odd"].product is None
    assert topology.nodes["bare"].ready
    assert topology.gpu_nodes == []


def test_disagreeing_labels_are_resolved_by_the_first_claim_and_reported() -> None:
    nodes = [
        fake.gpu_node("a", clique="rack1.0", labels={"kubernetes.io/rack": "r1"}),
        fake.gpu_node("b", clique="rack1.0", labels={"kubernetes.io/rack": "r2"}),
    ]
    topology = build_topology(nodes)
    assert topology.nodes["b"].rack == "r1"
    assert any("'r2' disagrees with 'r1'" in warning for warning in topology.warnings)


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        ([{"metadata": {}}], r"nodes\[0\]: metadata.name is missing"),
        ([fake.gpu_node("a"), fake.gpu_node("a")], r"nodes\[1\]: duplicate node name 'a'"),
        ([{"kind": "Pod", "metadata": {"name": "x"}}], r"nodes\[0\]: expected kind Node, got 'Pod'"),
    ],
)
def test_unreadable_node_lists_say_which_item(nodes: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        build_topology(nodes)


def test_label_keys_are_configurable() -> None:
    keys = LabelKeys.from_dict({"rack": ["example.com/rack"], "rackFromClique": False})
    nodes = [
        fake.gpu_node("a", clique="u1.0", labels={"example.com/rack": "row-1"}),
        fake.gpu_node("b", clique="u2.0", labels={"example.com/rack": "row-1"}),
        fake.gpu_node("c", clique="u3.0"),
    ]
    topology = build_topology(nodes, label_keys=keys)
    assert topology.tier("a", "b") is LinkTier.RACK
    assert topology.nodes["c"].rack is None
    with pytest.raises(ValueError, match="unknown keys"):
        LabelKeys.from_dict({"racks": ["x"]})
    with pytest.raises(ValueError, match=r"labels.rack: expected a list of label keys"):
        LabelKeys.from_dict({"rack": [1]})


def test_link_tiers_get_slower_and_are_overridable() -> None:
    links = LinkTable()
    times = [links[tier].ring_allreduce_us(8, 4 << 20) for tier in LinkTier]
    assert times == sorted(times)
    assert links[LinkTier.DOMAIN].ring_allreduce_us(1, 4 << 20) == 0.0
    custom = LinkTable.from_dict({"rack": {"bandwidthGBps": 100, "latencyUs": 2}})
    assert custom.rack.bandwidth_gbps == 100
    assert custom.block == links.block
    with pytest.raises(ValueError, match="unknown tier 'spine'"):
        LinkTable.from_dict({"spine": {}})
    with pytest.raises(ValueError, match=r"links.rack: bandwidth must be > 0"):
        LinkTable.from_dict({"rack": {"bandwidthGBps": 0}})


def test_taint_string_is_kubectl_style() -> None:
    assert str(Taint(key="gpu", value="bad", effect="NoExecute")) == "gpu=bad:NoExecute"
    assert str(Taint(key="gpu")) == "gpu:NoSchedule"


def test_topology_config_combines_labels_and_links() -> None:
    config = TopologyConfig.from_dict(
        {"labels": {"rack": "example.com/rack"}, "links": {"domain": {"latencyUs": 2.5}}}
    )
    assert config.labels.rack == ("example.com/rack",)
    assert config.links.domain.latency_us == 2.5
    assert TopologyConfig.from_dict(None) == TopologyConfig()
    with pytest.raises(ValueError, match=r"unknown keys \['link'\]"):
        TopologyConfig.from_dict({"link": {}})
    with pytest.raises(ValueError, match="links: expected an object"):
        TopologyConfig.from_dict({"links": [1]})
