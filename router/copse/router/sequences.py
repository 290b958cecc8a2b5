"""In-flight load per worker, as the router itself sees it (no engine metrics needed).

Every request the router sends is tracked from routing to its first token (*prefilling*) and on
to its end (*decoding*): per worker, the number of requests, the uncached prompt tokens still to
prefill and their predicted prefill time, the prompt blocks in use (deduplicated: two requests
sharing a prefix use its blocks once) and the KV tokens the worker will need.

The worker prefills its queue in arrival order, so the prefill backlog is the predicted time of
every request not yet prefilled minus the time the oldest one has already been running (capped
at its prediction): a worker that has been busy on a long prompt for a while is closer to free
than its raw backlog says.

Per-worker figures live in numpy arrays indexed by worker slot, so a policy reads all workers
at once; every change touches only the entries of the worker it concerns, and records that
worker's slot in :attr:`ActiveSequences.changed` for figures derived from these (the router's
cost terms, :class:`copse.router.cost.WorkerCosts`). The figures are rows of one array that a
compiled table (``loops.LoadTable``) updates, which also reference-counts the blocks in use per
(worker, block).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from copse.router import loops
from copse.router.indexer import Overlaps

FloatArray = npt.NDArray[np.float64]


@dataclasses.dataclass(slots=True)
class Flight:
    """One in-flight request on one worker."""

    slot: int
    hashes: Sequence[int]
    """Prompt block hashes (their KV is in use on the worker until the request ends)."""
    prefill_tokens: int
    """Uncached prompt tokens the worker must compute before the first token."""
    prefill_ms: float
    """Predicted compute time of that prefill alone (without per-step overheads)."""
    kv_tokens: float
    """KV tokens this request needs beyond its full prompt blocks (partial block + output)."""
    started: float
    """When it was routed (the clock of the caller), for the backlog and for expiry."""
    prefilling: bool = True
    output_tokens: int = 0
    """Output tokens the request is expected to generate (its ``max_tokens``; 0 when unknown)."""


ROWS = loops.LOAD_ROWS
"""Rows of :attr:`ActiveSequences.columns`, as the load table knows them."""


class ActiveSequences:
    """Per-worker in-flight requests and the load figures derived from them."""

    __slots__ = (
        "_flights",
        "_kv",
        "_load",
        "_pending",
        "active_blocks",
        "block_size",
        "changed",
        "columns",
        "free_flags",
        "head_ms",
        "head_start",
        "kv_extra",
        "outputs",
        "prefill_ms",
        "prefill_tokens",
        "prefilling",
        "requests",
        "step_ms",
    )

    def __init__(self, *, block_size: int, slots: int = 8) -> None:
        self.block_size = block_size
        """Tokens per block, to turn active blocks into KV tokens."""
        self._flights: dict[str, Flight] = {}
        self._load = loops.LoadTable(block_size=block_size)
        self._pending: list[OrderedDict[str, None]] = []
        self.changed: set[int] = set()
        """Slots whose figures changed since a consumer of derived figures last emptied the set."""
        self.columns: FloatArray = np.zeros((len(ROWS), 0))
        """Every per-worker figure, one row each (:data:`ROWS`); the attributes below are its rows."""
        self.requests: FloatArray = self.columns[0]
        """In-flight requests per worker."""
        self.prefilling: FloatArray = self.columns[0]
        """Requests per worker still waiting for their first token."""
        self.prefill_tokens: FloatArray = self.columns[0]
        """Uncached prompt tokens per worker still to prefill."""
        self.prefill_ms: FloatArray = self.columns[0]
        """Sum of predicted prefill compute times of the requests still prefilling, per worker."""
        self.active_blocks: FloatArray = self.columns[0]
        """Distinct full prompt blocks in use per worker."""
        self.kv_extra: FloatArray = self.columns[0]
        """KV tokens in use per worker beyond the full prompt blocks (partial blocks and outputs)."""
        self._kv: FloatArray = self.columns[0]
        self.head_start: FloatArray = self.columns[0]
        """When the oldest prefilling request of each worker was routed."""
        self.head_ms: FloatArray = self.columns[0]
        """Predicted prefill time of that oldest request (0 when none)."""
        self.step_ms: FloatArray = self.columns[0]
        """Kept by :class:`copse.router.cost.WorkerCosts` (which see), with :attr:`free_flags`."""
        self.free_flags: FloatArray = self.columns[0]
        self.outputs: FloatArray = np.zeros(0)
        """Expected output tokens of the in-flight requests per worker (their ``max_tokens``), which
        say how long the batch a new request joins lasts."""
        self.ensure(slots)

    def ensure(self, size: int) -> None:
        """Make room for worker slots ``0 .. size-1``."""
        old = len(self._pending)
        if size <= old:
            return
        size = max(size, 2 * old)
        columns = np.zeros((len(ROWS), size))
        columns[:, :old] = self.columns
        self.columns = columns
        self._load.bind(columns)
        (
            self.requests,
            self.prefilling,
            self.prefill_tokens,
            self.prefill_ms,
            self.active_blocks,
            self.kv_extra,
            self._kv,
            self.head_start,
            self.head_ms,
            self.step_ms,
            self.free_flags,
        ) = columns
        outputs = np.zeros(size)
        outputs[:old] = self.outputs
        self.outputs = outputs
        self._pending.extend(OrderedDict() for _ in range(size - old))
        self.changed.update(range(old, size))

    @property
    def size(self) -> int:
        """Length of the per-worker arrays."""
        return len(self._pending)

    @property
    def load(self) -> loops.LoadTable:
        """The compiled table the figures are kept by (bound to :attr:`columns`)."""
        return self._load

    def kv_tokens(self) -> FloatArray:
        """KV tokens in use per worker (deduplicated prompt blocks, partial blocks, outputs)."""
        return self._kv

    def __len__(self) -> int:
        return len(self._flights)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._flights

    def get(self, request_id: str) -> Flight | None:
        """The flight of ``request_id`` if it is in flight."""
        return self._flights.get(request_id)

    def add(
        self,
        request_id: str,
        *,
        slot: int,
        hashes: Sequence[int],
        prefill_tokens: int,
        prefill_ms: float,
        kv_tokens: float,
        now: float,
        output_tokens: int = 0,
    ) -> None:
        """Start tracking a request routed to ``slot`` (a request id already tracked is replaced);
        ``output_tokens``: what it is expected to generate (0 for a prefill-only charge)."""
        if request_id in self._flights:
            self.free(request_id)
        self.ensure(slot + 1)
        flight = Flight(
            slot=slot,
            hashes=hashes,
            prefill_tokens=prefill_tokens,
            prefill_ms=prefill_ms,
            kv_tokens=kv_tokens,
            started=now,
            output_tokens=output_tokens,
        )
        self._flights[request_id] = flight
        self.outputs[slot] += output_tokens
        self._load.add(slot, hashes, prefill_tokens, prefill_ms, kv_tokens)
        pending = self._pending[slot]
        pending[request_id] = None
        if len(pending) == 1:
            self.head_start[slot] = now
            self.head_ms[slot] = prefill_ms
        self.changed.add(slot)

    def prefill_done(self, request_id: str, *, now: float) -> int | None:
        """The request's first token arrived; returns its worker slot (``None`` if not tracked)."""
        flight = self._flights.get(request_id)
        if flight is None or not flight.prefilling:
            return None if flight is None else flight.slot
        self._end_prefill(request_id, flight, now=now)
        return flight.slot

    def free(self, request_id: str, *, now: float | None = None) -> int | None:
        """The request ended (or failed); returns its worker slot (``None`` if not tracked)."""
        flight = self._flights.pop(request_id, None)
        if flight is None:
            return None
        slot = flight.slot
        if flight.prefilling:
            self._end_prefill(request_id, flight, now=flight.started if now is None else now)
        self._load.free(slot, flight.hashes, flight.kv_tokens)
        self.outputs[slot] -= flight.output_tokens
        self.changed.add(slot)
        return slot

    def _end_prefill(self, request_id: str, flight: Flight, *, now: float) -> None:
        slot = flight.slot
        flight.prefilling = False
        self._load.end_prefill(slot, flight.prefill_tokens, flight.prefill_ms)
        self.changed.add(slot)
        pending = self._pending[slot]
        was_head = next(iter(pending)) == request_id
        del pending[request_id]
        if not pending:
            self.prefill_ms[slot] = 0.0
            self.head_ms[slot] = 0.0
        elif was_head:
            head = self._flights.get(next(iter(pending)))
            self.head_start[slot] = max(now, head.started) if head is not None else now
            self.head_ms[slot] = head.prefill_ms if head is not None else 0.0

    def active_prefix(self, hashes: Sequence[int]) -> Overlaps:
        """For every worker using at least the first block of ``hashes`` for an in-flight request:
        how many leading blocks it uses."""
        depths = self.active_prefix_array(hashes)
        return {int(slot): int(depths.item(slot)) for slot in np.flatnonzero(depths)}

    def active_prefix_array(self, hashes: Sequence[int]) -> FloatArray:
        """:meth:`active_prefix` as an array over every slot."""
        out = np.empty(self.size)
        self._load.leading_blocks(hashes, out)
        return out

    def keys_with_prefix(self, prefix: str) -> list[str]:
        """Ids of the tracked requests that start with ``prefix``."""
        return [request_id for request_id in self._flights if request_id.startswith(prefix)]

    def drop_worker(self, slot: int) -> list[str]:
        """Forget every request on ``slot`` (its worker left); returns their ids."""
        gone = [request_id for request_id, flight in self._flights.items() if flight.slot == slot]
        for request_id in gone:
            self.free(request_id)
        return gone

    def expire(self, *, now: float, max_age_s: float) -> list[str]:
        """Free requests routed more than ``max_age_s`` before ``now`` (their end was never seen,
        e.g. a peer router died); returns their ids."""
        old: list[str] = []
        for request_id, flight in self._flights.items():
            if now - flight.started <= max_age_s:
                break
            old.append(request_id)
        for request_id in old:
            self.free(request_id, now=now)
        return old
