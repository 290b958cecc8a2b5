"""Placement state over a topology, with the exact cost change of adding or removing a group.

Nodes with GPUs are indexed once; they fall into *cells*, one per (NVLink domain, GPU
product), because a group never mixes products. Per eligibility class (tolerations and node
selector) a histogram counts, per cell, the eligible nodes with f free GPUs; that makes the
cost of putting a group into every cell a handful of array operations, so a group costs
O(cells), never an enumeration of node subsets.

A group's pods are uniform: ``pod_size`` GPUs each (the largest divisor of the group's GPUs
that fits a node of that product), one pod per node. Inside a cell the best nodes are the
fullest ones that still fit a pod (best fit), which is exactly what minimises the node
fragmentation term.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from copse.placement.cost import CostModel, comm_us, kv_us, pod_size, uniform_comm_us, waste
from copse.placement.model import KV_COUNTERPART, ExpertParallel, GroupKey, GroupRequest, PlacementRequest
from copse.topology.graph import Topology
from copse.topology.kube import Toleration
from copse.topology.links import LinkTier

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
Eligibility = tuple[tuple[Toleration, ...], tuple[tuple[str, str], ...]]
PodChoice = list[tuple[int, int]]
"""A group's pods as (node index, GPUs), in rank order."""
Parallel = tuple[int, int, ExpertParallel | None]
"""What a group's communication cost depends on (:attr:`GroupRequest.parallel`)."""


@dataclass
class _View:
    """Nodes one eligibility class may use, and per cell how many of them have f free GPUs."""

    eligible: BoolArray
    hist: IntArray


@dataclass
class Placed:
    """A group in the engine's state: its pods (node indices, GPUs) and where they lie."""

    group: GroupRequest
    nodes: list[int]
    gpus: list[int]
    domains: frozenset[int]
    racks: frozenset[int]
    blocks: frozenset[int]
    cell_gpus: dict[int, int] = field(default_factory=dict)
    """GPUs per cell on counted nodes: what the domain fragmentation term sees."""


@dataclass(frozen=True)
class _Shape:
    """Per cell, what does not change while placing: pod shape, fit mask, node-waste table, comm."""

    pod_gpus: IntArray
    pods: IntArray
    fits: BoolArray
    node_delta: FloatArray
    comm: FloatArray


@dataclass(frozen=True)
class CellTerms:
    """Per cell: can the group go there whole, its pod shape, and the cost terms that do not
    depend on other groups of the deployment."""

    feasible: BoolArray
    pod_gpus: IntArray
    pods: IntArray
    comm: FloatArray
    fragmentation: FloatArray
    taken: IntArray
    """Per cell and free-GPU count, how many nodes the best fit takes."""


@dataclass
class _CachedTerms:
    terms: CellTerms
    dirty: set[int]
    """Cells whose free GPUs changed since ``terms`` was computed."""


class Engine:
    """Free GPUs per node and the groups placed so far, for one request on one topology.

    ``add``/``remove`` are exact inverses, so strategies may try moves and undo them.
    """

    def __init__(self, topology: Topology, request: PlacementRequest, model: CostModel) -> None:
        self.topology = topology
        self.request = request
        self.model = model
        self.links = topology.links
        nodes = topology.gpu_nodes
        self.names = [node.name for node in nodes]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.cap = np.array([node.gpus for node in nodes], dtype=np.int64)
        # Fragmentation is measured over the nodes ordinary pods can use: Ready and not cordoned.
        # (A view that tolerates cordons sees more nodes; its cell costs are then approximate.)
        self.counted = np.array([node.ready and not node.cordoned for node in nodes], dtype=np.bool_)
        self.free = np.maximum(self.cap - np.array([node.used for node in nodes], dtype=np.int64), 0)

        products = sorted({node.product or "" for node in nodes})
        self.product_names: list[str | None] = [name or None for name in products]
        product_code = {name: i for i, name in enumerate(products)}
        self.node_product = np.array([product_code[node.product or ""] for node in nodes], dtype=np.int64)
        self.product_cap = np.zeros(len(products), dtype=np.int64)
        np.maximum.at(self.product_cap, self.node_product, self.cap)

        domain_names = sorted({node.domain for node in nodes})
        self.domain_names = domain_names
        domain_code = {name: i for i, name in enumerate(domain_names)}
        rack_code: dict[tuple[str, str], int] = {}
        block_code: dict[tuple[str, str], int] = {}
        self.rack_names: list[str | None] = []
        domain_rack = np.zeros(len(domain_names), dtype=np.int64)
        domain_block = np.zeros(len(domain_names), dtype=np.int64)
        for d, name in enumerate(domain_names):
            domain = topology.domains[name]
            # Unknown levels get an id of their own, so nothing else shares them.
            rack_key = ("rack", domain.rack) if domain.rack is not None else ("domain", name)
            if rack_key not in rack_code:
                rack_code[rack_key] = len(rack_code)
                self.rack_names.append(domain.rack)
            block_key = ("block", domain.block) if domain.block is not None else rack_key
            block_code.setdefault(block_key, len(block_code))
            domain_rack[d] = rack_code[rack_key]
            domain_block[d] = block_code[block_key]
        self.n_racks = len(rack_code)
        self.n_blocks = len(block_code)
        self.domain_rack = domain_rack
        self.domain_block = domain_block
        self.node_domain = np.array([domain_code[node.domain] for node in nodes], dtype=np.int64)
        self.node_rack = domain_rack[self.node_domain]
        self.node_block = domain_block[self.node_domain]

        cells = sorted({(int(d), int(p)) for d, p in zip(self.node_domain, self.node_product, strict=True)})
        cell_code = {cell: i for i, cell in enumerate(cells)}
        self.cell_of = np.array(
            [cell_code[(int(d), int(p))] for d, p in zip(self.node_domain, self.node_product, strict=True)],
            dtype=np.int64,
        )
        self.cell_domain = np.array([d for d, _ in cells], dtype=np.int64)
        self.cell_product = np.array([p for _, p in cells], dtype=np.int64)
        self.cell_rack = domain_rack[self.cell_domain]
        self.cell_block = domain_block[self.cell_domain]
        self.cell_nodes: list[IntArray] = [np.flatnonzero(self.cell_of == c) for c in range(len(cells))]
        self.n_cells = len(cells)
        counted_cap = np.where(self.counted, self.cap, 0)
        self.cell_cap = np.bincount(self.cell_of, weights=counted_cap, minlength=self.n_cells).astype(
            np.float64
        )
        self.cell_free = np.bincount(
            self.cell_of, weights=np.where(self.counted, self.free, 0), minlength=self.n_cells
        ).astype(np.float64)
        self.max_gpus = int(self.cap.max()) if len(self.cap) else 0

        self._views: dict[Eligibility, _View] = {}
        self.pending: dict[str, dict[GroupKey, GroupRequest]] = {}
        """Groups the scheduler has yet to place, by role (for the KV look-ahead)."""
        self.placed: dict[GroupKey, Placed] = {}
        self.role_racks: dict[str, IntArray] = {}
        self.presence: dict[str, tuple[IntArray, IntArray, IntArray]] = {}
        self.role_count: dict[str, int] = {}
        self.single_domain: dict[str, IntArray] = {}
        """Per role, placed groups lying in one domain, counted per domain (for KV sums)."""
        self.multi_domain: dict[str, dict[GroupKey, Placed]] = {}
        """Per role, placed groups spanning domains."""
        self._kv = {tier: kv_us(links=self.links, model=model, tier=tier) for tier in LinkTier}
        self._kv_table = np.array([self._kv[tier] for tier in LinkTier], dtype=np.float64)
        self._comm_cache: dict[tuple[Parallel, int], float] = {}
        self._pod_sizes: dict[int, IntArray] = {}
        self._shapes: dict[Parallel, _Shape] = {}
        self._terms: dict[tuple[Parallel, Eligibility], _CachedTerms] = {}

    # -- eligibility ------------------------------------------------------------------------

    def view(self, group: GroupRequest) -> _View:
        key = group.eligibility
        view = self._views.get(key)
        if view is None:
            nodes = self.topology.nodes
            selector = dict(group.node_selector)
            eligible = np.array(
                [not nodes[name].blockers(group.tolerations, selector) for name in self.names],
                dtype=np.bool_,
            )
            hist = np.zeros((self.n_cells, self.max_gpus + 1), dtype=np.int64)
            np.add.at(hist, (self.cell_of[eligible], np.clip(self.free[eligible], 0, self.max_gpus)), 1)
            view = _View(eligible=eligible, hist=hist)
            self._views[key] = view
        return view

    # -- shapes and the costs that depend only on where a group goes ----------------------------

    def pod_sizes(self, gpus: int) -> IntArray:
        """Pod size per product for a group of ``gpus`` GPUs."""
        sizes = self._pod_sizes.get(gpus)
        if sizes is None:
            sizes = np.array([pod_size(gpus, int(cap)) for cap in self.product_cap], dtype=np.int64)
            self._pod_sizes[gpus] = sizes
        return sizes

    def single_domain_comm(self, group: GroupRequest, pod_gpus: int) -> float:
        """Comm cost of the group as equal pods of ``pod_gpus`` inside one NVLink domain."""
        key = (group.parallel, pod_gpus)
        cost = self._comm_cache.get(key)
        if cost is None:
            pods = group.gpus // pod_gpus
            cost = uniform_comm_us(
                links=self.links,
                model=self.model,
                tensor_parallelism=group.tensor_parallelism,
                pipeline_parallelism=group.pipeline_parallelism,
                pods=pods,
                pod_gpus=pod_gpus,
                between=LinkTier.DOMAIN,
                moe=group.moe,
            )
            self._comm_cache[key] = cost
        return cost

    def _shape(self, group: GroupRequest) -> _Shape:
        key = group.parallel
        shape = self._shapes.get(key)
        if shape is None:
            sizes = self.pod_sizes(group.gpus)
            pod_gpus = sizes[self.cell_product]
            bins = np.arange(self.max_gpus + 1, dtype=np.int64)
            per_node = self.product_cap[self.cell_product].astype(np.float64)[:, None]
            size = pod_gpus.astype(np.float64)[:, None]
            comm_by_product = np.array(
                [self.single_domain_comm(group, int(size)) for size in sizes], dtype=np.float64
            )
            shape = _Shape(
                pod_gpus=pod_gpus,
                pods=group.gpus // pod_gpus,
                fits=bins[None, :] >= pod_gpus[:, None],
                # W(f - p) - W(f) for a node of nominal capacity C: p (2f - C - p) / C
                node_delta=self.model.node_fragmentation_us
                * size
                * (2 * bins[None, :] - per_node - size)
                / per_node,
                comm=comm_by_product[self.cell_product],
            )
            self._shapes[key] = shape
        return shape

    def _rows(self, group: GroupRequest, rows: IntArray | slice) -> tuple[BoolArray, FloatArray, IntArray]:
        """Feasibility, fragmentation change and best-fit take for the cells in ``rows``."""
        shape = self._shape(group)
        counts = self.view(group).hist[rows] * shape.fits[rows]
        pods = shape.pods[rows]
        before = np.cumsum(counts, axis=1) - counts
        taken = np.clip(pods[:, None] - before, 0, counts)
        node_term = (taken * shape.node_delta[rows]).sum(axis=1)
        # W(f - g) - W(f) for a cell of capacity c: g (2f - g - c) / c
        capacity = self.cell_cap[rows]
        safe = np.where(capacity > 0, capacity, 1.0)
        cell_term = np.where(
            capacity > 0,
            self.model.domain_fragmentation_us
            * group.gpus
            * (2 * self.cell_free[rows] - group.gpus - capacity)
            / safe,
            0.0,
        )
        return counts.sum(axis=1) >= pods, node_term + cell_term, taken

    def cell_terms(self, group: GroupRequest) -> CellTerms:
        """Per-cell terms for ``group``; cached per shape, only cells changed since are recomputed.

        The arrays are valid until the next state change.
        """
        key = (group.parallel, group.eligibility)
        cached = self._terms.get(key)
        if cached is None:
            feasible, fragmentation, taken = self._rows(group, slice(None))
            shape = self._shape(group)
            cached = _CachedTerms(
                terms=CellTerms(
                    feasible=feasible,
                    pod_gpus=shape.pod_gpus,
                    pods=shape.pods,
                    comm=shape.comm,
                    fragmentation=fragmentation,
                    taken=taken,
                ),
                dirty=set(),
            )
            self._terms[key] = cached
        elif cached.dirty:
            rows = np.fromiter(cached.dirty, dtype=np.int64, count=len(cached.dirty))
            feasible, fragmentation, taken = self._rows(group, rows)
            cached.terms.feasible[rows] = feasible
            cached.terms.fragmentation[rows] = fragmentation
            cached.terms.taken[rows] = taken
            cached.dirty.clear()
        return cached.terms

    def kv_of(self, tier: LinkTier) -> float:
        return self._kv[tier]

    def _nearest(
        self, role: str, domains: Iterable[int], racks: Iterable[int], blocks: Iterable[int]
    ) -> LinkTier:
        """Tier to the nearest placed group of ``role``; BEYOND while none is placed (its KV
        will have to travel to wherever one lands)."""
        if not self.role_count.get(role):
            return LinkTier.BEYOND
        dom_count, rack_count, block_count = self.presence[role]
        if any(dom_count[d] for d in domains):
            return LinkTier.DOMAIN
        if any(rack_count[r] for r in racks):
            return LinkTier.RACK
        if any(block_count[b] for b in blocks):
            return LinkTier.BLOCK
        return LinkTier.BEYOND

    def _domain_nearest(self, role: str) -> IntArray:
        """Per domain, the tier to the nearest placed group of ``role`` (BEYOND while none)."""
        if not self.role_count.get(role):
            return np.full(len(self.domain_names), int(LinkTier.BEYOND), dtype=np.int64)
        dom_count, rack_count, block_count = self.presence[role]
        result: IntArray = np.where(
            dom_count > 0,
            int(LinkTier.DOMAIN),
            np.where(
                rack_count[self.domain_rack] > 0,
                int(LinkTier.RACK),
                np.where(block_count[self.domain_block] > 0, int(LinkTier.BLOCK), int(LinkTier.BEYOND)),
            ),
        )
        return result

    def kv_partner_role(self, role: str) -> str | None:
        """The role ``role`` ships KV to, if this request has it."""
        other = KV_COUNTERPART.get(role)
        return other if other in self.request.roles else None

    def nearest_counterpart(self, placed: Placed) -> LinkTier | None:
        """KV tier from a placed group to the nearest counterpart group (None: no KV moves)."""
        other = self.kv_partner_role(placed.group.role)
        if other is None:
            return None
        return self._nearest(other, placed.domains, placed.racks, placed.blocks)

    def kv_delta_cells(self, group: GroupRequest, *, partner_beside: bool = False) -> FloatArray | float:
        """Change of the total KV term if the group went into each cell (``partner_beside``: a
        counterpart group comes into the same cell with it, as in a bundle)."""
        other = self.kv_partner_role(group.role)
        if other is None:
            return 0.0
        if partner_beside:
            own_tier = np.full(self.n_cells, int(LinkTier.DOMAIN))
        elif self.role_count.get(other):
            dom_count, rack_count, block_count = self.presence[other]
            own_tier = np.where(
                dom_count[self.cell_domain] > 0,
                int(LinkTier.DOMAIN),
                np.where(
                    rack_count[self.cell_rack] > 0,
                    int(LinkTier.RACK),
                    np.where(block_count[self.cell_block] > 0, int(LinkTier.BLOCK), int(LinkTier.BEYOND)),
                ),
            )
        else:
            own_tier = np.full(self.n_cells, int(LinkTier.BEYOND))
        kv_table = self._kv_table
        # Partners in one domain, all at once: for each domain, the change of their KV if this
        # group lands at tier t from them, then summed per domain/rack/block it would land in.
        count = self.single_domain.get(other, np.zeros(len(self.domain_names), dtype=np.int64))
        current = self._domain_nearest(group.role)
        values = [
            count * (kv_table[np.minimum(current, int(tier))] - kv_table[current])
            for tier in (LinkTier.DOMAIN, LinkTier.RACK, LinkTier.BLOCK, LinkTier.BEYOND)
        ]
        base = float(values[3].sum())
        add_block = np.bincount(self.domain_block, weights=values[2] - values[3], minlength=self.n_blocks)
        add_rack = np.bincount(self.domain_rack, weights=values[1] - values[2], minlength=self.n_racks)
        add_dom = values[0] - values[1]
        tiers = (LinkTier.DOMAIN, LinkTier.RACK, LinkTier.BLOCK, LinkTier.BEYOND)
        for partner in self.multi_domain.get(other, {}).values():
            nearest = self._nearest(group.role, partner.domains, partner.racks, partner.blocks)
            value = {tier: self._kv[min(nearest, tier)] - self._kv[nearest] for tier in tiers}
            base += value[LinkTier.BEYOND]
            for b in partner.blocks:
                add_block[b] += value[LinkTier.BLOCK] - value[LinkTier.BEYOND]
            for r in partner.racks:
                add_rack[r] += value[LinkTier.RACK] - value[LinkTier.BLOCK]
            for d in partner.domains:
                add_dom[d] += value[LinkTier.DOMAIN] - value[LinkTier.RACK]
        result: FloatArray = (
            kv_table[own_tier]
            + base
            + add_block[self.cell_block]
            + add_rack[self.cell_rack]
            + add_dom[self.cell_domain]
        )
        return result

    def bundle_costs(self, members: Sequence[GroupRequest]) -> FloatArray:
        """Per cell, the cost of putting all ``members`` (same eligibility) into it together
        (inf where they do not all fit): each takes its best fit of what the previous left.

        Exact for the comm and fragmentation terms; KV and spread are counted against the
        groups already placed, a member's own KV as NVLink-near when its counterpart is in the
        bundle. Like :meth:`partner_lookahead`, it charges a cell left without room for the next
        group that will want to sit beside the bundle.
        """
        hist = self.view(members[0]).hist.copy()
        rows = np.arange(self.n_cells)
        bins = np.arange(self.max_gpus + 1, dtype=np.int64)
        feasible = np.ones(self.n_cells, dtype=np.bool_)
        cost = np.zeros(self.n_cells)
        roles = {member.role for member in members}
        for member in members:
            shape = self._shape(member)
            counts = hist * shape.fits
            feasible &= counts.sum(axis=1) >= shape.pods
            before = np.cumsum(counts, axis=1) - counts
            taken = np.clip(shape.pods[:, None] - before, 0, counts)
            cost += (taken * shape.node_delta).sum(axis=1) + shape.comm
            beside = KV_COUNTERPART.get(member.role) in roles
            cost += self.kv_delta_cells(member, partner_beside=beside) + self.spread_cells(member)
            hist -= taken
            # Each taken node moves from f to f - p free GPUs.
            target = np.maximum(bins[None, :] - shape.pod_gpus[:, None], 0)
            np.add.at(hist, (np.broadcast_to(rows[:, None], target.shape), target), taken * shape.fits)
        partner = self._pending_partner(roles, exclude=members)
        if partner is not None:
            room = (hist * self._shape(partner).fits).sum(axis=1)
            cost += self._no_room_penalty(partner, room)
        gpus = sum(member.gpus for member in members)
        capacity = self.cell_cap
        safe = np.where(capacity > 0, capacity, 1.0)
        cost += np.where(
            capacity > 0,
            self.model.domain_fragmentation_us * gpus * (2 * self.cell_free - gpus - capacity) / safe,
            0.0,
        )
        result: FloatArray = np.where(feasible, cost, np.inf)
        return result

    def _no_room_penalty(self, partner: GroupRequest, room: IntArray) -> FloatArray:
        """Per cell: 0 when ``room`` (its nodes that fit a partner pod) holds ``partner``, else the
        extra KV cost of the nearest other cell that can: in the same rack, block, or beyond."""
        elsewhere = self.cell_terms(partner).feasible.astype(np.float64)
        in_rack = (
            np.bincount(self.cell_rack, weights=elsewhere, minlength=self.n_racks)[self.cell_rack] > elsewhere
        )
        in_block = (
            np.bincount(self.cell_block, weights=elsewhere, minlength=self.n_blocks)[self.cell_block]
            > elsewhere
        )
        kv = self._kv
        tier_cost = np.where(
            in_rack, kv[LinkTier.RACK], np.where(in_block, kv[LinkTier.BLOCK], kv[LinkTier.BEYOND])
        )
        result: FloatArray = np.where(room >= self._shape(partner).pods, 0.0, tier_cost - kv[LinkTier.DOMAIN])
        return result

    def _pending_partner(self, roles: set[str], exclude: Sequence[GroupRequest] = ()) -> GroupRequest | None:
        """A group still to place whose KV goes to one of ``roles``."""
        skip = {group.key for group in exclude}
        for role, groups in self.pending.items():
            if KV_COUNTERPART.get(role) in roles:
                for key, group in groups.items():
                    if key not in skip:
                        return group
        return None

    def partner_lookahead(self, group: GroupRequest, terms: CellTerms) -> FloatArray | float:
        """A greedy heuristic, not part of the cost: if the counterpart role still has groups to
        place, charge a cell that would have no room left for one of them next to this group
        (its KV would then cross the fabric instead of NVLink)."""
        partner = self._pending_partner({group.role})
        if partner is None:
            return 0.0
        partner_shape = self._shape(partner)
        bins = np.arange(self.max_gpus + 1, dtype=np.int64)
        remaining = np.clip(self.view(partner).hist - terms.taken, 0, None)
        room = (remaining * partner_shape.fits).sum(axis=1)
        # Nodes the group takes keep f - p free GPUs, which may still hold a partner pod.
        after = bins[None, :] - terms.pod_gpus[:, None]
        room += (terms.taken * (after >= partner_shape.pod_gpus[:, None])).sum(axis=1)
        return self._no_room_penalty(partner, room)

    def spread_cells(self, group: GroupRequest) -> FloatArray | float:
        if not self.request.spread_racks:
            return 0.0
        counts = self.role_racks.get(group.role)
        if counts is None:
            return 0.0
        result: FloatArray = self.model.spread_us * counts[self.cell_rack].astype(np.float64)
        return result

    def best_nodes(self, group: GroupRequest, cell: int, pod_gpus: int, pods: int) -> list[int]:
        """Best fit inside a cell: the eligible nodes with the fewest free GPUs that still fit a pod."""
        eligible = self.view(group).eligible
        members = [int(i) for i in self.cell_nodes[cell] if eligible[i] and self.free[i] >= pod_gpus]
        members.sort(key=lambda i: (int(self.free[i]), i))
        return sorted(members[:pods])

    # -- exact cost of one concrete placement --------------------------------------------------

    def _sets(self, nodes: Sequence[int]) -> tuple[frozenset[int], frozenset[int], frozenset[int]]:
        return (
            frozenset(int(self.node_domain[i]) for i in nodes),
            frozenset(int(self.node_rack[i]) for i in nodes),
            frozenset(int(self.node_block[i]) for i in nodes),
        )

    def tier(self, a: int, b: int) -> LinkTier:
        if a == b:
            return LinkTier.NODE
        if self.node_domain[a] == self.node_domain[b]:
            return LinkTier.DOMAIN
        if self.node_rack[a] == self.node_rack[b]:
            return LinkTier.RACK
        if self.node_block[a] == self.node_block[b]:
            return LinkTier.BLOCK
        return LinkTier.BEYOND

    def ring_order(self, choice: PodChoice) -> PodChoice:
        """Pods sorted along the tree, so neighbouring ranks are as close as they can be."""
        return sorted(
            choice,
            key=lambda pod: (
                int(self.node_block[pod[0]]),
                int(self.node_rack[pod[0]]),
                int(self.node_domain[pod[0]]),
                pod[0],
            ),
        )

    def comm(self, group: GroupRequest, choice: PodChoice) -> float:
        nodes = [node for node, _ in choice]
        return comm_us(
            links=self.links,
            model=self.model,
            tensor_parallelism=group.tensor_parallelism,
            pipeline_parallelism=group.pipeline_parallelism,
            pod_gpus=[gpus for _, gpus in choice],
            tier=[[self.tier(a, b) for b in nodes] for a in nodes],
            moe=group.moe,
        )

    def fragmentation_delta(self, choice: PodChoice, sign: int) -> float:
        """Change of the fragmentation terms when ``choice`` is taken (+1) or given back (-1)."""
        per_cell: dict[int, int] = {}
        node_term = 0.0
        for node, gpus in choice:
            if not self.counted[node]:
                continue
            per_cell[int(self.cell_of[node])] = per_cell.get(int(self.cell_of[node]), 0) + gpus
            capacity = float(self.product_cap[self.node_product[node]])
            before = float(max(self.free[node], 0))
            after = float(max(self.free[node] - sign * gpus, 0))
            node_term += waste(after, capacity) - waste(before, capacity)
        cell_term = 0.0
        for cell, gpus in per_cell.items():
            capacity = float(self.cell_cap[cell])
            before = float(self.cell_free[cell])
            cell_term += waste(before - sign * gpus, capacity) - waste(before, capacity)
        return self.model.domain_fragmentation_us * cell_term + self.model.node_fragmentation_us * node_term

    def kv_delta(self, group: GroupRequest, choice: PodChoice) -> float:
        other = self.kv_partner_role(group.role)
        if other is None:
            return 0.0
        domains, racks, blocks = self._sets([node for node, _ in choice])
        delta = self._kv[self._nearest(other, domains, racks, blocks)]
        count = self.single_domain.get(other)
        if count is not None and count.any():
            doms = np.arange(len(self.domain_names))
            between = np.where(
                np.isin(doms, list(domains)),
                int(LinkTier.DOMAIN),
                np.where(
                    np.isin(self.domain_rack, list(racks)),
                    int(LinkTier.RACK),
                    np.where(
                        np.isin(self.domain_block, list(blocks)), int(LinkTier.BLOCK), int(LinkTier.BEYOND)
                    ),
                ),
            )
            current = self._domain_nearest(group.role)
            kv_table = self._kv_table
            delta += float((count * (kv_table[np.minimum(current, between)] - kv_table[current])).sum())
        for partner in self.multi_domain.get(other, {}).values():
            between_tier = _set_tier(domains, racks, blocks, partner)
            current_tier = self._nearest(group.role, partner.domains, partner.racks, partner.blocks)
            delta += self._kv[min(current_tier, between_tier)] - self._kv[current_tier]
        return delta

    def fragmentation_level(self) -> float:
        """The fragmentation terms of the current state (not a change): >= 0."""
        capacity = self.cell_cap
        safe = np.where(capacity > 0, capacity, 1.0)
        domains = np.where(capacity > 0, self.cell_free * (capacity - self.cell_free) / safe, 0.0).sum()
        per_node = self.product_cap[self.node_product].astype(np.float64)
        free = np.clip(self.free, 0, None).astype(np.float64)
        nodes = np.where(self.counted, free * (per_node - free) / per_node, 0.0).sum()
        return float(self.model.domain_fragmentation_us * domains + self.model.node_fragmentation_us * nodes)

    def objective(self) -> float:
        """The total cost of the current state, fragmentation counted in full (not as a change)."""
        total = self.fragmentation_level()
        for placed in self.placed.values():
            total += self.comm(placed.group, list(zip(placed.nodes, placed.gpus, strict=True)))
            nearest = self.nearest_counterpart(placed)
            if nearest is not None:
                total += self._kv[nearest]
        if self.request.spread_racks:
            for counts in self.role_racks.values():
                total += self.model.spread_us * float((counts * (counts - 1) / 2).sum())
        return total

    def spread_delta(self, group: GroupRequest, choice: PodChoice) -> float:
        """Change of the spread term: one more pair with every same-role group in each rack it uses."""
        if not self.request.spread_racks or group.role not in self.role_racks:
            return 0.0
        _, racks, _ = self._sets([node for node, _ in choice])
        counts = self.role_racks[group.role]
        return self.model.spread_us * float(sum(int(counts[r]) for r in racks))

    def marginal(self, group: GroupRequest, choice: PodChoice) -> float:
        """Exact change of the total cost if ``group`` is added with these pods."""
        return (
            self.comm(group, choice)
            + self.kv_delta(group, choice)
            + self.spread_delta(group, choice)
            + self.fragmentation_delta(choice, +1)
        )

    # -- state changes ------------------------------------------------------------------------

    def _move(self, choice: PodChoice, sign: int) -> None:
        for node, gpus in choice:
            before = int(self.free[node])
            after = before - sign * gpus
            self.free[node] = after
            cell = int(self.cell_of[node])
            if self.counted[node]:
                self.cell_free[cell] += max(after, 0) - max(before, 0)
            for cached in self._terms.values():
                cached.dirty.add(cell)
            for view in self._views.values():
                if view.eligible[node]:
                    view.hist[cell, min(max(before, 0), self.max_gpus)] -= 1
                    view.hist[cell, min(max(after, 0), self.max_gpus)] += 1

    def _count(self, placed: Placed, sign: int) -> None:
        role = placed.group.role
        if role not in self.role_racks:
            self.role_racks[role] = np.zeros(self.n_racks, dtype=np.int64)
            self.presence[role] = (
                np.zeros(len(self.domain_names), dtype=np.int64),
                np.zeros(self.n_racks, dtype=np.int64),
                np.zeros(self.n_blocks, dtype=np.int64),
            )
        if role not in self.single_domain:
            self.single_domain[role] = np.zeros(len(self.domain_names), dtype=np.int64)
            self.multi_domain[role] = {}
        if len(placed.domains) == 1:
            self.single_domain[role][next(iter(placed.domains))] += sign
        elif sign > 0:
            self.multi_domain[role][placed.group.key] = placed
        else:
            del self.multi_domain[role][placed.group.key]
        self.role_count[role] = self.role_count.get(role, 0) + sign
        for r in placed.racks:
            self.role_racks[role][r] += sign
        dom_count, rack_count, block_count = self.presence[role]
        for d in placed.domains:
            dom_count[d] += sign
        for r in placed.racks:
            rack_count[r] += sign
        for b in placed.blocks:
            block_count[b] += sign

    def add(self, group: GroupRequest, choice: PodChoice) -> Placed:
        if group.key in self.placed:
            raise ValueError(f"group {group.role}-{group.replica} is already placed")
        ordered = self.ring_order(choice)
        nodes = [node for node, _ in ordered]
        domains, racks, blocks = self._sets(nodes)
        cell_gpus: dict[int, int] = {}
        for node, gpus in ordered:
            if self.counted[node]:
                cell = int(self.cell_of[node])
                cell_gpus[cell] = cell_gpus.get(cell, 0) + gpus
        placed = Placed(
            group=group,
            nodes=nodes,
            gpus=[gpus for _, gpus in ordered],
            domains=domains,
            racks=racks,
            blocks=blocks,
            cell_gpus=cell_gpus,
        )
        self._move(ordered, +1)
        self._count(placed, +1)
        self.placed[group.key] = placed
        return placed

    def remove(self, key: GroupKey) -> Placed:
        placed = self.placed.pop(key)
        self._move(list(zip(placed.nodes, placed.gpus, strict=True)), -1)
        self._count(placed, -1)
        return placed

    def removal_delta(self, key: GroupKey) -> float:
        """Exact change of the total cost if the placed group ``key`` were removed."""
        placed = self.remove(key)
        choice = list(zip(placed.nodes, placed.gpus, strict=True))
        delta = -self.marginal(placed.group, choice)
        self.add(placed.group, choice)
        return delta


def _set_tier(
    domains: frozenset[int], racks: frozenset[int], blocks: frozenset[int], other: Placed
) -> LinkTier:
    if domains & other.domains:
        return LinkTier.DOMAIN
    if racks & other.racks:
        return LinkTier.RACK
    if blocks & other.blocks:
        return LinkTier.BLOCK
    return LinkTier.BEYOND
