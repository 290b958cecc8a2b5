"""Which model each worker serves and which LoRA adapters it holds: the router's side of
several models and adapters behind one entry point.

- **Models.** A request goes only to workers of the base model it names (its ``model``, or its
  adapter's base model).
- **Adapters held.** An engine holds at most ``max_loras`` adapters (TensorRT-LLM's
  ``lora_config.max_loras``) and evicts the least recently used one for a new one. The tracker
  mirrors that LRU per worker from the requests this router sends (an engine's cache changes only
  when a request names an adapter, so one router that sends every request knows it exactly; with
  several replicas each knows what it sent). A worker that does not hold the request's adapter
  costs an adapter load (``load_ms``) on top of its predicted time to first token, which is how
  the ``kv`` policy prefers workers that hold it.
- **Shared between replicas.** Several router replicas each send part of the requests, so each
  alone would know only the adapter loads its own requests caused. Replicas share every request
  they route over NATS (:mod:`copse.router.replica_sync`, with its adapter), and each replays its
  peers' requests into its own LRU (:meth:`AdapterTracker.routed` with ``peer=True``): every
  replica then sees the engines' adapter caches as one router sending everything would. A
  replica that joins, or missed messages, merges a peer's view from its snapshot
  (:meth:`AdapterTracker.merge`).
- **Adapters at once.** A worker whose requests in flight already use ``max_loras`` adapters, none
  of them this request's, cannot take it without waiting for one of them to finish: it is left
  out while another worker can take the request.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict

import numpy as np
import numpy.typing as npt

from copse.router.policies import RouteRequest
from copse.workers.mocker.adapters import AdapterSettings

BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterRouting(AdapterSettings):
    """How the router weighs adapters: what it assumes of the engines (the engine's own settings,
    with their defaults and checks: ``max_loras`` where an engine's ``/worker_info`` does not say
    it, the operator renders the same figure into ``lora_config.max_loras``; ``load_ms`` added to
    the predicted time to first token of a worker that does not hold the adapter) and whether it
    prefers workers that hold it."""

    aware: bool = True
    """Prefer workers that hold the request's adapter; off (adapter-blind), only the block hashes
    (which include the adapter) and the adapters-at-once limit see adapters."""
    shared: bool = True
    """Mirror the adapters peer replicas' requests use (off: each replica knows only the loads its
    own requests caused, for comparison)."""


@dataclasses.dataclass(slots=True)
class _Worker:
    model: str
    max_loras: int
    held: OrderedDict[str, None] = dataclasses.field(default_factory=OrderedDict)
    """Adapters held, least recently used first."""
    running: Counter[str] = dataclasses.field(default_factory=Counter)
    """Requests in flight per adapter."""


class AdapterTracker:
    """Per worker slot: its model, the adapters it holds and those its requests in flight use."""

    def __init__(self, settings: AdapterRouting | None = None) -> None:
        self.settings = settings or AdapterRouting()
        self._workers: dict[int, _Worker] = {}
        self._flights: dict[str, tuple[tuple[int, ...], str]] = {}
        """Request id -> (slots it runs on, its adapter), for requests through an adapter."""
        self.loads = 0
        """Adapter loads this router's routing caused (as predicted from the mirrored LRU)."""
        self.peer_loads = 0
        """Adapter loads its peer replicas' requests caused, as mirrored here."""

    def set_worker(
        self, slot: int, *, model: str, max_loras: int | None = None, held: tuple[str, ...] = ()
    ) -> None:
        """Register (or update) the worker in ``slot``: the model it serves, the adapters it holds
        at once (``None``: the configured figure) and those it reports holding, least recently used
        first (what its engine said when it registered)."""
        capacity = max_loras or self.settings.max_loras
        worker = self._workers.get(slot)
        if worker is None or worker.model != model:
            worker = self._workers[slot] = _Worker(model=model, max_loras=capacity)
            worker.held.update(dict.fromkeys(held[-capacity:]))
        worker.max_loras = capacity
        while len(worker.held) > capacity:  # its engine now holds fewer: it evicted the least recent
            worker.held.popitem(last=False)

    def drop_worker(self, slot: int) -> None:
        """Forget the worker in ``slot`` (it left)."""
        self._workers.pop(slot, None)

    def serves(self, model: str) -> bool:
        """Whether a registered worker serves ``model``."""
        return any(worker.model == model for worker in self._workers.values())

    def merge(self, slot: int, held: list[str]) -> None:
        """Merge a peer replica's view that the worker in ``slot`` holds ``held`` (least recently
        used first, from its snapshot: it saw requests this replica missed) into this replica's:
        the peer's adapters count as less recent than those this replica saw itself (a snapshot
        comes whenever a peer joins and at every sequence gap, after this replica's own routing),
        at most ``max_loras`` are kept, and an adapter with requests in flight is never dropped."""
        worker = self._workers.get(slot)
        if worker is None:
            return
        merged = OrderedDict.fromkeys(name for name in held if name not in worker.held)
        merged.update(worker.held)
        excess = len(merged) - worker.max_loras
        for name in [name for name in merged if name not in worker.running][: max(excess, 0)]:
            del merged[name]
        worker.held = merged

    def adapter_of(self, request_id: str) -> str:
        """The adapter ``request_id`` runs through ("": none, or not known here)."""
        flight = self._flights.get(request_id)
        return "" if flight is None else flight[1]

    def held(self, slot: int) -> list[str]:
        """Adapters the worker in ``slot`` is believed to hold, least recently used first."""
        worker = self._workers.get(slot)
        return [] if worker is None else list(worker.held)

    def running(self, slot: int) -> list[str]:
        """Adapters the requests in flight on the worker in ``slot`` use."""
        worker = self._workers.get(slot)
        return [] if worker is None else sorted(worker.running)

    def narrow(self, request: RouteRequest, mask: BoolArray) -> BoolArray:
        """Of ``mask``'s workers, those that serve the request's model and can start its adapter now
        (when any of them can: otherwise those of its model, where it waits in the engine)."""
        if not request.model and not request.adapter:
            return mask
        out = mask.copy()
        adapter = request.adapter
        blocked = []
        for slot in np.flatnonzero(mask).tolist():
            worker = self._workers.get(slot)
            if worker is None or (request.model and worker.model != request.model):
                out[slot] = False
            elif adapter and adapter not in worker.running and len(worker.running) >= worker.max_loras:
                out[slot] = False
                blocked.append(slot)
        if blocked and not out.any():
            out[blocked] = True
        return out

    def load_ms(self, request: RouteRequest, size: int) -> FloatArray | None:
        """Predicted adapter load time on each of ``size`` slots, ms (``None``: nothing to load
        anywhere, the request names no adapter, or adapter-blind routing)."""
        adapter = request.adapter
        if not adapter or not self.settings.aware or self.settings.load_ms == 0.0:
            return None
        out = np.zeros(size)
        for slot, worker in self._workers.items():
            if slot < size and adapter not in worker.held:
                out[slot] = self.settings.load_ms
        return out

    def routed(self, request_id: str, *, slots: tuple[int, ...], adapter: str, peer: bool = False) -> None:
        """``request_id`` through ``adapter`` went to ``slots`` (its prefill and decode workers):
        each holds the adapter now, most recently used, evicting its least recently used one.
        ``peer``: a peer replica routed it (its loads count in :attr:`peer_loads`)."""
        if request_id in self._flights:  # routed again (a retry): its previous attempt ended
            self.finished(request_id)
        if not adapter:
            return
        for slot in slots:
            worker = self._workers.get(slot)
            if worker is None:
                continue
            if adapter in worker.held:
                worker.held.move_to_end(adapter)
            else:
                if len(worker.held) >= worker.max_loras:
                    worker.held.popitem(last=False)
                worker.held[adapter] = None
                if peer:
                    self.peer_loads += 1
                else:
                    self.loads += 1
            worker.running[adapter] += 1
        self._flights[request_id] = (slots, adapter)

    def finished(self, request_id: str) -> None:
        """``request_id`` ended (or failed): its adapter no longer runs on its workers for it."""
        flight = self._flights.pop(request_id, None)
        if flight is None:
            return
        slots, adapter = flight
        for slot in slots:
            worker = self._workers.get(slot)
            if worker is not None:
                worker.running[adapter] -= 1
                if worker.running[adapter] <= 0:
                    del worker.running[adapter]
