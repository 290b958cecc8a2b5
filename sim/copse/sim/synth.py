"""The workload synthesizer: learn a Mooncake trace's prefix tree, then sample new requests.

Learning (``PrefixModel.learn``):

* the prefix tree is a ``networkx`` directed graph over hash ids (each id names a whole prefix),
  rooted at a virtual root; every node counts the requests that pass through it;
* a request's *shared context* is the leading run of its blocks that at least one other request
  also has (visits >= 2); the rest of its prompt is its *user prompt*, never shared. Leaves seen
  once are therefore not part of the tree that is sampled: their lengths are sampled empirically;
* each node also counts the requests whose shared context ends exactly there.

Sampling (``PrefixModel.sample``) walks the tree from the root, at each node stopping or moving
to a child with probability proportional to those counts (which reproduces the trace's
distribution of shared contexts), then draws a user-prompt length, an output length and an
inter-arrival gap from the trace's empirical distributions. Knobs:

* ``prefix_len_multiplier``: the shared context becomes this many times longer (each sampled
  context block expands into blocks that are shared exactly as the original was);
* ``prefix_root_multiplier``: that many independent copies of the tree (ids offset per copy),
  each request drawing one copy: less sharing across requests;
* ``prompt_len_multiplier`` / ``osl_multiplier``: scale user prompts / output lengths;
* ``speedup_ratio``: divides inter-arrival gaps (more load).

Output rows follow the Mooncake format (``timestamp``, ``input_length``, ``output_length``,
``hash_ids``) plus ``context_len`` and ``unique_user_prompt_len`` (tokens).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from typing import IO, Any

import networkx as nx
import numpy as np
import numpy.typing as npt

from copse.sim.trace import TraceRequest

ROOT = -1
"""The virtual root of the prefix tree (hash ids are non-negative)."""


@dataclasses.dataclass(frozen=True, slots=True)
class SynthKnobs:
    """How sampled requests differ from the learned trace."""

    num_requests: int = 1000
    """Requests to sample."""
    seed: int = 0
    """Seeds every draw: the same knobs and trace give the same requests."""
    prefix_len_multiplier: float = 1.0
    """Scales the length of the shared context."""
    prefix_root_multiplier: int = 1
    """Independent copies of the prefix tree."""
    prompt_len_multiplier: float = 1.0
    """Scales the length of the unshared user prompt."""
    osl_multiplier: float = 1.0
    """Scales output lengths."""
    speedup_ratio: float = 1.0
    """Divides inter-arrival gaps."""

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be at least 1, got {self.num_requests}")
        if self.prefix_root_multiplier < 1:
            raise ValueError(f"prefix_root_multiplier must be at least 1, got {self.prefix_root_multiplier}")
        for name in ("prefix_len_multiplier", "prompt_len_multiplier", "osl_multiplier", "speedup_ratio"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, got {value}")


@dataclasses.dataclass(frozen=True, slots=True)
class SynthRequest:
    """One sampled request."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    context_len: int
    """Tokens of shared context (whole blocks)."""
    unique_user_prompt_len: int
    """Tokens of the request's own prompt after the context."""

    def as_json(self) -> dict[str, Any]:
        return {
            "timestamp": round(self.timestamp_ms, 3),
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
            "context_len": self.context_len,
            "unique_user_prompt_len": self.unique_user_prompt_len,
        }


class PrefixModel:
    """What :func:`PrefixModel.learn` keeps of a trace (see the module documentation)."""

    def __init__(
        self,
        *,
        tree: nx.DiGraph,
        block_size: int,
        user_prompt_lengths: npt.NDArray[np.int64],
        output_lengths: npt.NDArray[np.int64],
        gaps_ms: npt.NDArray[np.float64],
    ) -> None:
        self.tree = tree
        self.block_size = block_size
        self.user_prompt_lengths = user_prompt_lengths
        self.output_lengths = output_lengths
        self.gaps_ms = gaps_ms
        self.max_id = max((int(n) for n in tree.nodes if n != ROOT), default=0)
        # Transition tables per node: children, and cumulative weights with "stop" last.
        self._choices: dict[int, tuple[list[int], npt.NDArray[np.float64]]] = {}
        for node in tree.nodes:
            children = sorted(tree.successors(node))
            weights = [tree.nodes[c]["visits"] for c in children] + [tree.nodes[node]["ends"]]
            self._choices[node] = (children, np.cumsum(np.asarray(weights, dtype=np.float64)))

    @classmethod
    def learn(cls, trace: Sequence[TraceRequest], *, block_size: int = 512) -> PrefixModel:
        """Learn from ``trace`` (requests in arrival order)."""
        if not trace:
            raise ValueError("cannot learn from an empty trace")
        visits: dict[int, int] = {}
        for request in trace:
            for block in request.hash_ids:
                visits[block] = visits.get(block, 0) + 1
        tree = nx.DiGraph()
        tree.add_node(ROOT, visits=len(trace), ends=0)
        user_prompts = []
        for request in trace:
            parent = ROOT
            shared = 0
            for block in request.hash_ids:
                if visits[block] < 2:
                    break
                if block not in tree:
                    tree.add_node(block, visits=visits[block], ends=0)
                    tree.add_edge(parent, block)
                parent = block
                shared += 1
            # Context is whole blocks: a partially filled last block belongs to the user prompt.
            shared = min(shared, request.input_length // block_size)
            end = request.hash_ids[shared - 1] if shared else ROOT
            tree.nodes[end]["ends"] += 1
            user_prompts.append(request.input_length - shared * block_size)
        stamps = np.array([r.timestamp_ms for r in trace], dtype=np.float64)
        return cls(
            tree=tree,
            block_size=block_size,
            user_prompt_lengths=np.array(user_prompts, dtype=np.int64),
            output_lengths=np.array([r.output_length for r in trace], dtype=np.int64),
            gaps_ms=np.diff(stamps) if len(stamps) > 1 else np.zeros(1),
        )

    def _walk(self, rng: np.random.Generator) -> list[int]:
        path: list[int] = []
        node = ROOT
        while True:
            children, cumulative = self._choices[node]
            if not children or cumulative[-1] <= 0:
                return path
            pick = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
            if pick >= len(children):
                return path
            node = children[pick]
            path.append(node)

    def sample(self, knobs: SynthKnobs) -> list[SynthRequest]:
        """Sample ``knobs.num_requests`` requests."""
        rng = np.random.default_rng(knobs.seed)
        size = self.block_size
        span = self.max_id + 1
        expanded: dict[tuple[int, int], int] = {}
        next_id = span * knobs.prefix_root_multiplier
        out: list[SynthRequest] = []
        now = 0.0
        for index in range(knobs.num_requests):
            if index:
                now += float(rng.choice(self.gaps_ms)) / knobs.speedup_ratio
            copy = int(rng.integers(knobs.prefix_root_multiplier))
            path = [block + copy * span for block in self._walk(rng)]
            blocks = round(len(path) * knobs.prefix_len_multiplier)
            context: list[int] = []
            for i in range(blocks):
                key = (path[min(int(i / knobs.prefix_len_multiplier), len(path) - 1)], i)
                if knobs.prefix_len_multiplier == 1.0:
                    context.append(key[0])
                    continue
                found = expanded.get(key)
                if found is None:
                    found = expanded[key] = next_id
                    next_id += 1
                context.append(found)
            user = max(1, round(int(rng.choice(self.user_prompt_lengths)) * knobs.prompt_len_multiplier))
            own_blocks = -(-user // size)
            own = list(range(next_id, next_id + own_blocks))
            next_id += own_blocks
            output = max(1, round(int(rng.choice(self.output_lengths)) * knobs.osl_multiplier))
            out.append(
                SynthRequest(
                    timestamp_ms=now,
                    input_length=len(context) * size + user,
                    output_length=output,
                    hash_ids=tuple(context + own),
                    context_len=len(context) * size,
                    unique_user_prompt_len=user,
                )
            )
        return out


def write_jsonl(requests: Iterable[SynthRequest], handle: IO[str]) -> None:
    """Write requests as Mooncake JSONL."""
    for request in requests:
        handle.write(json.dumps(request.as_json()) + "\n")
