"""Mixture-of-Experts for the mocker and the router: the model's expert popularity, expert
placement over EP ranks (static, or rebalanced EPLB-style) and the step-time terms an expert-
parallel engine adds (all-to-all, the slowest rank's imbalance). Pure numpy, no I/O."""

from copse.workers.moe.placement import ExpertPlacement, eplb, static_placement
from copse.workers.moe.popularity import ExpertPopularity, skewed_popularity
from copse.workers.moe.step import MoeConfig, MoeStep, moe_terms, step_terms

__all__ = [
    "ExpertPlacement",
    "ExpertPopularity",
    "MoeConfig",
    "MoeStep",
    "eplb",
    "moe_terms",
    "skewed_popularity",
    "static_placement",
    "step_terms",
]
