"""What class a request belongs to: its objective (priority and TTFT target) and its tenant.

- The objective is named in the ``x-gateway-inference-objective`` header: the name of an
  ``InferenceObjective`` (Gateway API Inference Extension, ``inference.networking.x-k8s.io``),
  whose ``spec.priority`` orders the router's queue (higher first). copse reads objectives from
  the router config (``objectives:``; not yet from InferenceObjective objects in Kubernetes). A
  request naming no objective, or one the router does not know, gets the default objective
  (priority 0 unless configured), as the endpoint picker does.
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
        self._objectives = dict(objectives or {})
        self.default = default or Objective(name="")
        """What a request naming no objective, or an unknown one, gets."""
        self._weights = dict(weights or {})
        self._default_weight = default_weight

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
