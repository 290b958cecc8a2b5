"""What class a request belongs to: its objective (priority and TTFT target) and its tenant.

- The objective is named in the ``x-gateway-inference-objective`` header: the name of an
  ``InferenceObjective`` (Gateway API Inference Extension, ``inference.networking.x-k8s.io``),
  whose ``spec.priority`` orders the router's queue (higher first). copse reads objectives from
  the router config (``objectives:``, with their TTFT targets) and, with ``inference_objectives:``,
  from the InferenceObjective objects of its pool in Kubernetes (:mod:`copse.router.objective_source`):
  an object's priority wins over the config's for the same name, and its TTFT and ITL targets are
  the config's entry of that name, else the default objective's. A request naming no objective, or
  one the router does not know, gets the default objective (priority 0 unless configured), as the
  endpoint picker does.
- The tenant is the client's API key (``Authorization: Bearer ...``, never shown: a hash of it),
  else the ``x-gateway-inference-fairness-id`` header, else the one default tenant (empty name).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from copse.router.clients import tenant_of

OBJECTIVE_HEADER = "x-gateway-inference-objective"
"""Names the request's InferenceObjective."""


@dataclasses.dataclass(frozen=True, slots=True)
class Objective:
    """A serving objective requests name."""

    name: str
    """The InferenceObjective's name ("" for the default objective)."""
    priority: int = 0
    """Higher is served first while requests wait, and shed last."""
    ttft_ms: float | None = None
    """Time-to-first-token target: a request predicted to wait past it is shed (429) instead of
    queued; ``None``: queued while the queue has room."""
    itl_ms: float | None = None
    """Inter-token target: while its requests decode on a worker, requests of lower priority go
    elsewhere (or wait) when they would make that worker's steps longer than it; ``None``: none."""


class Classes:
    """Objectives by name and tenant weights; resolves a request's class from its headers."""

    def __init__(
        self,
        *,
        objectives: Mapping[str, Objective] | None = None,
        default: Objective | None = None,
        weights: Mapping[str, float] | None = None,
        default_weight: float = 1.0,
    ) -> None:
        self._configured = dict(objectives or {})
        self._objectives = dict(self._configured)
        self.default = default or Objective(name="")
        """What a request naming no objective, or an unknown one, gets."""
        self._weights = dict(weights or {})
        self._default_weight = default_weight

    def set_priorities(self, priorities: Mapping[str, int]) -> None:
        """The InferenceObjectives read from Kubernetes now (name -> ``spec.priority``), replacing
        those read before; configured objectives they do not name stay as configured."""
        objectives = dict(self._configured)
        for name, priority in priorities.items():
            configured = self._configured.get(name)
            targets = configured if configured is not None else self.default
            objectives[name] = Objective(
                name=name, priority=priority, ttft_ms=targets.ttft_ms, itl_ms=targets.itl_ms
            )
        self._objectives = objectives

    def objective(self, name: str | None) -> Objective:
        """The objective called ``name`` (the default when unknown or ``None``)."""
        if not name:
            return self.default
        return self._objectives.get(name, self.default)

    def of(self, headers: Mapping[str, str]) -> tuple[Objective, str]:
        """The objective and tenant of a request with these (lower-case) headers."""
        return self.objective(headers.get(OBJECTIVE_HEADER, "").strip()), tenant_of(headers)

    def weight(self, tenant: str) -> float:
        """A tenant's fair-share weight."""
        return self._weights.get(tenant, self._default_weight)
