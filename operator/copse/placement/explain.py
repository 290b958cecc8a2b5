"""Why a group could not be placed, in one sentence a person can act on."""

from __future__ import annotations

from collections import Counter

import numpy as np

from copse.placement.engine import Engine
from copse.placement.model import GroupRequest


def _blocker_summary(engine: Engine, group: GroupRequest) -> str:
    """``3 NotReady, 2 cordoned, 1 with taint gpu=bad:NoSchedule`` over the GPU nodes."""
    selector = dict(group.node_selector)
    reasons: Counter[str] = Counter()
    for name in engine.names:
        for reason in engine.topology.nodes[name].blockers(group.tolerations, selector):
            reasons[reason] += 1
    parts = []
    for reason, count in sorted(reasons.items(), key=lambda item: (-item[1], item[0])):
        if reason.startswith(("taint ", "nodeSelector ")):
            kind, _, what = reason.partition(" ")
            verb = "not tolerated" if kind == "taint" else "not matched"
            parts.append(f"{count} with {kind} {what} {verb}")
        else:
            parts.append(f"{count} {reason}")
    return ", ".join(parts)


def explain(engine: Engine, group: GroupRequest) -> str:
    """The reason ``group`` fits nowhere in the engine's current state."""
    shape = f"needs {group.gpus} GPUs (TP {group.tensor_parallelism} x PP {group.pipeline_parallelism})"
    view = engine.view(group)
    excluded = _blocker_summary(engine, group)
    if not len(engine.names):
        return f"{shape}; the node list has no node with allocatable GPUs"
    if not view.eligible.any():
        return f"{shape}; no GPU node can take its pods: {excluded}"

    terms = engine.cell_terms(group)
    sizes = engine.pod_sizes(group.gpus)
    fits_now = np.array(
        [
            int(np.sum(view.eligible[nodes] & (engine.free[nodes] >= terms.pod_gpus[cell])))
            for cell, nodes in enumerate(engine.cell_nodes)
        ]
    )
    usable_cap = np.array(
        [
            int(np.sum(engine.cap[nodes][view.eligible[nodes] & (engine.cap[nodes] >= terms.pod_gpus[cell])]))
            for cell, nodes in enumerate(engine.cell_nodes)
        ]
    )
    sentences = [shape]
    products = sorted({int(p) for p in engine.node_product[view.eligible]})
    shapes = [
        f"{group.gpus // int(sizes[p])} pods x {int(sizes[p])} GPUs"
        + (f" on {engine.product_names[p]}" if len(products) > 1 and engine.product_names[p] else "")
        for p in products
    ]
    sentences[0] += " as " + " or ".join(shapes)
    largest = int(usable_cap.max())
    if largest < group.gpus:
        sentences.append(f"larger than any NVLink domain it may use (largest: {largest} GPUs)")
    else:
        best = int(np.argmax(fits_now - terms.pods))
        sentences.append(
            f"the best NVLink domain, {engine.domain_names[engine.cell_domain[best]]}, has "
            f"{fits_now[best]} node(s) with >= {terms.pod_gpus[best]} free GPUs of the "
            f"{terms.pods[best]} it needs"
        )
    free_total = int(np.sum(np.clip(engine.free[view.eligible], 0, None)))
    sentences.append(f"{free_total} GPUs are free on the {int(view.eligible.sum())} nodes it may use")
    across = any(
        int(np.sum(view.eligible & (engine.node_product == p) & (engine.free >= sizes[p])))
        >= group.gpus // int(sizes[p])
        for p in products
    )
    if engine.request.same_domain and across:
        sentences.append("it would fit across NVLink domains, but affinityPolicy is same-nvswitch-domain")
    placed = len(engine.placed)
    if placed:
        sentences.append(f"after placing {placed} other group(s) of this deployment")
    if excluded:
        sentences.append(f"excluded nodes: {excluded}")
    return "; ".join(sentences)
