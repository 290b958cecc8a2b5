"""InferenceObjective objects read from Kubernetes: the priority of each objective requests name
in ``x-gateway-inference-objective``.

An ``InferenceObjective`` (Gateway API Inference Extension, ``inference.networking.x-k8s.io/v1alpha2``
up to its v1.5.0; the same schema moved to llm-d's router as ``llm-d.ai/v1alpha2`` when v1.6.0
dropped it) names an InferencePool in ``spec.poolRef.name`` and gives ``spec.priority`` (an
integer, higher first; unset counts as 0, as the endpoint picker does). The router lists the
objects of its namespace every ``interval_s`` and keeps those of its pool (a list, not a watch:
objectives change rarely, and a list needs one verb and no resourceVersion bookkeeping).

:func:`priorities_of` is the pure part; :class:`ObjectiveFollower` does the listing and hands each
changed set to a callback (:meth:`copse.router.objectives.Classes.set_priorities`). A failed list
(no CRD, no RBAC, API server away) keeps the objectives last read and is logged once per
distinct error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

log = logging.getLogger(__name__)

DEFAULT_API_VERSION = "inference.networking.x-k8s.io/v1alpha2"
"""The Inference Extension's InferenceObjective (its v1.0 to v1.5 releases)."""
PLURAL = "inferenceobjectives"


def priorities_of(items: Iterable[Mapping[str, Any]], *, pool: str | None) -> dict[str, int]:
    """Objective name -> ``spec.priority`` (0 when unset) of the objects of ``pool`` (every object
    with ``pool`` ``None``); an object without a name, being deleted, or with a priority that is
    not an integer is skipped (the API server's schema forbids the last, a fake may not)."""
    out: dict[str, int] = {}
    for item in items:
        metadata = item.get("metadata") or {}
        spec = item.get("spec") or {}
        name = metadata.get("name")
        if not isinstance(name, str) or not name or metadata.get("deletionTimestamp"):
            continue
        pool_ref = spec.get("poolRef") or {}
        if pool is not None and pool_ref.get("name") != pool:
            continue
        priority = spec.get("priority", 0)
        if priority is None:
            priority = 0
        if isinstance(priority, bool) or not isinstance(priority, int):
            log.warning("InferenceObjective %s: spec.priority %r is not an integer; ignored", name, priority)
            continue
        out[name] = priority
    return out


class ObjectiveListError(RuntimeError):
    """Listing the objectives failed (the API server refused, or could not be reached)."""


class ObjectiveApi(Protocol):
    """The one Kubernetes call the follower makes (a fake in tests, ``kubernetes.aio`` in pods)."""

    async def list_objectives(self, *, namespace: str, api_version: str) -> list[dict[str, Any]]:
        """The InferenceObjective objects of ``namespace`` (Kubernetes JSON); raises
        :class:`ObjectiveListError`."""
        ...


class ObjectiveFollower:
    """Lists a namespace's InferenceObjectives every ``interval_s`` and reports each changed set."""

    def __init__(
        self,
        api: ObjectiveApi,
        *,
        namespace: str,
        pool: str | None,
        api_version: str,
        interval_s: float,
        on_change: Callable[[dict[str, int]], None],
    ) -> None:
        self._api = api
        self.namespace = namespace
        self.pool = pool
        self.api_version = api_version
        self.interval_s = interval_s
        self._on_change = on_change
        self.current: dict[str, int] | None = None
        """The priorities last reported (``None`` before the first successful list)."""
        self._last_error: str | None = None

    async def poll(self) -> None:
        """One list; reports the priorities when they changed."""
        try:
            items = await self._api.list_objectives(namespace=self.namespace, api_version=self.api_version)
        except ObjectiveListError as exc:
            error = str(exc)
            if error != self._last_error:
                log.warning(
                    "cannot list %s InferenceObjectives in namespace %s (%s); keeping the %d objectives "
                    "read before",
                    self.api_version,
                    self.namespace,
                    error,
                    len(self.current or {}),
                )
            self._last_error = error
            return
        self._last_error = None
        priorities = priorities_of(items, pool=self.pool)
        if priorities != self.current:
            log.info(
                "InferenceObjectives of pool %s: %s",
                self.pool or "(any)",
                ", ".join(f"{name}={priority}" for name, priority in sorted(priorities.items())) or "none",
            )
            self.current = priorities
            self._on_change(dict(priorities))

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            await self.poll()
            await asyncio.sleep(self.interval_s)
