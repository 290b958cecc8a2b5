"""The fault suite's scenarios, settings and results (the run itself: :mod:`copse.sim.fault_suite`).

The fault suite: a fixed load of concurrent streams through real router processes to real
mocked-engine processes on 127.0.0.1, with one fault injected mid-stream per scenario.

Every scenario starts from scratch: a ``nats-server``, one ``copse worker mock`` process per
engine (so that a signal reaches exactly one engine) and one or two ``copse router run``
processes, all on loopback. The client opens ``streams`` streamed completions at once (token-id
prompts in groups sharing a prefix), waits until they have received a third of their tokens on
average, injects the fault, and reads every stream to its end. It compares each stream's token
ids with the no-fault run (the mocked engines sample deterministically: an id depends on its
position and the sequence's first token only, so a correct migration reproduces them exactly).

A client behaves like an OpenAI client behind a Kubernetes Service: a connection that fails
before any output is retried on the next router replica; a stream whose connection drops
mid-way (only a killed router replica does that: the router migrates streams whose engine
failed) is counted as broken and retried from scratch on the next replica, its partial output
discarded. Everything is bounded: each scenario has a deadline and every process is killed at
its end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

MODEL = "fault-suite"
DEPLOYMENT = "fault-suite"

SCENARIOS: dict[str, str] = {
    "none": "no fault: the reference outputs",
    "engine-kill": "(a) one engine SIGKILLed",
    "two-engines-kill": "(b) two engines SIGKILLed at once",
    "nats-restart": "(c) NATS SIGKILLed, restarted 1 s later",
    "router-kill": "(d) one of two router replicas SIGKILLed; clients retry on the other",
    "router-drain": "(d') one of two router replicas SIGTERMed: it drains",
    "engine-hang": "(e) one engine SIGSTOPped: accepts connections, never answers",
}
"""Scenario name -> what it does."""


@dataclasses.dataclass(frozen=True, slots=True)
class FaultSettings:
    """The load and the engines every scenario runs."""

    streams: int = 200
    """Streams opened at once."""
    engines: int = 8
    """Mocked engines, one process each."""
    max_tokens: int = 128
    """Output tokens per stream."""
    prompt_tokens: int = 320
    """Prompt length: a prefix shared by the streams of a group, then a distinct suffix."""
    groups: int = 8
    """Prompt groups (distinct first tokens, so distinct outputs)."""
    decode_speedup: float = 0.25
    """The engines' ``--decode-speedup``: below 1 stretches streams over a few seconds."""
    deadline_s: float = 120.0
    """Longest a scenario may run once its streams are open."""

    def __post_init__(self) -> None:
        if self.streams < 1 or self.engines < 3 or self.max_tokens < 6 or self.groups < 1:
            raise ValueError("the fault suite needs at least 1 stream, 3 engines and 6 tokens per stream")
        if self.prompt_tokens <= 32:
            raise ValueError("prompt_tokens must exceed one 32-token block")


@dataclasses.dataclass(slots=True)
class StreamOutcome:
    """One stream as its client saw it."""

    ids: list[int]
    completed: bool
    """It ended with ``[DONE]`` (possibly after client retries)."""
    error: str = ""
    """Why it failed, when it did."""
    broken: int = 0
    """Times its connection dropped mid-stream (each followed by a retry from scratch)."""
    max_gap_s: float = 0.0
    """Longest wait between two output chunks."""


@dataclasses.dataclass(slots=True)
class ScenarioResult:
    """What one scenario measured."""

    scenario: str
    streams: int
    completed: int
    token_exact: int
    """Completed streams whose token ids equal the no-fault run's."""
    failed: int
    broken: int
    """Streams whose connection dropped mid-way at least once (then retried by their client)."""
    migrations: dict[str, int]
    """Router migrations by reason (summed over replicas still running at the end)."""
    max_gap_s: float
    """Longest wait a client saw between two output chunks."""
    wall_s: float
    """From opening the streams to the last one ending."""
    note: str = ""

    @property
    def ok(self) -> bool:
        """Every stream completed, token-exactly."""
        return self.failed == 0 and self.token_exact == self.streams


def prompts(settings: FaultSettings) -> list[list[int]]:
    """The prompts of the load: ``groups`` shared prefixes, then a distinct suffix per stream."""
    prefix = settings.prompt_tokens - 32
    out = []
    for index in range(settings.streams):
        group = index % settings.groups
        head = [1000 + 97 * group + i for i in range(prefix)]
        tail = [20000 + 37 * index + i for i in range(32)]
        out.append(head + tail)
    return out


def table(results: Sequence[ScenarioResult]) -> str:
    """The results as a Markdown table."""
    lines = [
        "| scenario | streams | completed | token-exact | failed | broken (client retried) "
        "| migrations | longest gap s | wall s |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in results:
        migrations = ", ".join(f"{reason} {count}" for reason, count in sorted(r.migrations.items())) or "0"
        lines.append(
            f"| {SCENARIOS[r.scenario]} | {r.streams} | {r.completed} | {r.token_exact} | {r.failed} "
            f"| {r.broken} | {migrations} | {r.max_gap_s:.2f} | {r.wall_s:.1f} |"
        )
    notes = [f"- {SCENARIOS[r.scenario]}: {r.note}" for r in results if r.note]
    return "\n".join(lines + (["", *notes] if notes else []))


def as_json(results: Sequence[ScenarioResult]) -> list[dict[str, Any]]:
    """The results as JSON-ready dicts."""
    return [{**dataclasses.asdict(r), "description": SCENARIOS[r.scenario]} for r in results]
