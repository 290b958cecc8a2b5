"""A synthetic Mixture-of-Experts workload: a few request classes, each with its own system prompt
(and so, to the mocked model, its own expert preferences), as Mooncake JSONL.

Every request starts with its class's shared prefix blocks (what the KV-aware router can reuse,
and what the mocked model's expert routing keys on), followed by blocks of its own; within a class
conversations continue: a follow-up repeats an earlier request of the class in full and appends a
turn. Arrivals are Poisson.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import IO, Any

import numpy as np

TRACE_BLOCK = 512
"""Tokens per hash id (Mooncake's block)."""


@dataclasses.dataclass(frozen=True, slots=True)
class MoeWorkload:
    """Knobs of the synthetic workload."""

    requests: int = 4000
    rate: float = 20.0
    """Mean arrivals per second."""
    class_weights: tuple[float, ...] = (0.4, 0.3, 0.2, 0.1)
    """Share of requests per class (one class per entry)."""
    prefix_blocks: int = 4
    """Blocks of each class's shared system prompt."""
    user_blocks: tuple[int, int] = (1, 4)
    """Range of a request's own blocks (inclusive)."""
    follow_up: float = 0.3
    """Chance that a request continues an earlier conversation of its class."""
    output_mean: float = 300.0
    """Mean output tokens (lognormal, sigma 0.6)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1 or not self.rate > 0:
            raise ValueError(f"requests ({self.requests}) and rate ({self.rate}) must be positive")
        if not self.class_weights or min(self.class_weights) <= 0:
            raise ValueError(f"class weights must be positive, got {self.class_weights}")
        low, high = self.user_blocks
        if not 1 <= low <= high or self.prefix_blocks < 1:
            raise ValueError(f"need prefix_blocks >= 1 and 1 <= user blocks, got {self.user_blocks}")
        if not 0.0 <= self.follow_up < 1.0 or not self.output_mean >= 1:
            raise ValueError("follow_up must lie in [0, 1) and output_mean be at least 1")


def generate(workload: MoeWorkload) -> list[dict[str, Any]]:
    """The workload's requests as Mooncake records (plus ``class`` for analysis; replay ignores it)."""
    rng = np.random.default_rng(workload.seed)
    weights = np.asarray(workload.class_weights) / sum(workload.class_weights)
    next_id = 1 + len(weights) * workload.prefix_blocks
    history: list[list[list[int]]] = [[] for _ in weights]
    now = 0.0
    records = []
    for _ in range(workload.requests):
        now += float(rng.exponential(1000.0 / workload.rate))
        cls = int(rng.choice(len(weights), p=weights))
        if history[cls] and rng.random() < workload.follow_up:
            base = history[cls][int(rng.integers(len(history[cls])))]
        else:
            base = [1 + cls * workload.prefix_blocks + j for j in range(workload.prefix_blocks)]
        own = int(rng.integers(workload.user_blocks[0], workload.user_blocks[1] + 1))
        hash_ids = [*base, *range(next_id, next_id + own)]
        next_id += own
        history[cls].append(hash_ids)
        input_length = len(hash_ids) * TRACE_BLOCK - int(rng.integers(0, TRACE_BLOCK // 2))
        sigma = 0.6
        output = rng.lognormal(np.log(workload.output_mean) - sigma**2 / 2, sigma)
        records.append(
            {
                "timestamp": round(now, 3),
                "input_length": input_length,
                "output_length": max(1, int(output)),
                "hash_ids": hash_ids,
                "class": cls,
            }
        )
    return records


def write_jsonl(records: Iterable[dict[str, Any]], handle: IO[str]) -> None:
    for record in records:
        handle.write(json.dumps(record) + "\n")
