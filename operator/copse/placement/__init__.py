"""Gang placement of TP groups onto NVLink domains: cost model, scheduler, scale-down victims.

Pure functions over a :class:`copse.topology.Topology`; no I/O, no CRD models.
"""

from copse.placement.cost import CostModel
from copse.placement.model import (
    DECODE,
    PREFILL,
    WORKER,
    ExpertParallel,
    GroupCost,
    GroupKey,
    GroupPlacement,
    GroupRequest,
    PlacedGroup,
    PlacementRequest,
    Plan,
    Pod,
    Unplaced,
    pool,
)
from copse.placement.scheduler import (
    STRATEGIES,
    choose_victims,
    evaluate,
    invalid_groups,
    plan,
    unready_groups,
)

__all__ = [
    "DECODE",
    "PREFILL",
    "STRATEGIES",
    "WORKER",
    "CostModel",
    "ExpertParallel",
    "GroupCost",
    "GroupKey",
    "GroupPlacement",
    "GroupRequest",
    "PlacedGroup",
    "PlacementRequest",
    "Plan",
    "Pod",
    "Unplaced",
    "choose_victims",
    "evaluate",
    "invalid_groups",
    "plan",
    "pool",
    "unready_groups",
]
