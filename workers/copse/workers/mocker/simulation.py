"""A discrete-event driver for many mocked engines on one virtual clock (no asyncio, no sleeping).

A trace replay with a router in the loop looks like::

    sim = Simulator([Engine(worker_id=f"w{i}", config=cfg, perf=perf) for i in range(16)],
                    on_step=lambda index, out: ...)        # first tokens, finishes, per step
    for arrival in trace:                                  # in time order
        sim.run_until(arrival.at_ms)                       # every step ending by then has ended
        for engine in sim.engines:
            router.apply(engine.worker_id, engine.drain_kv_events())
        index = router.choose(arrival)
        sim.submit(index, request_id=..., tokens=..., max_tokens=...)
    sim.run()                                              # drain: run until every engine is idle
    sim.outcomes                                           # RequestOutcome per finished request

Engines start a step as soon as they are idle and have work; the step's outputs appear when the
clock reaches its end. The same arrivals in the same order give the same result.

Decode fusion runs identical decode-only steps of an engine as one, up to its next block
boundary, finish or KV transfer, and up to the time given to :meth:`Simulator.run_until` (or,
with ``fuse_until_submit``, past it); a request submitted to the engine meanwhile cuts them
short at the step end where stepping one by one would first see the request.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from copse.workers.mocker.engine import Engine, Request, RequestOutcome, StepOutput

StepCallback = Callable[[int, StepOutput], None]


class Simulator:
    """Engines sharing a virtual clock in milliseconds."""

    def __init__(
        self,
        engines: Sequence[Engine],
        *,
        start_ms: float = 0.0,
        on_step: StepCallback | None = None,
        fuse_decode: bool = True,
        fuse_until_submit: bool = False,
    ) -> None:
        """``on_step`` sees every step output; with ``fuse_decode`` (exact, and much faster) runs of
        decode-only steps between two :meth:`run_until` times arrive as one output covering several
        steps; with ``fuse_until_submit`` too, runs between two :meth:`submit` calls to their engine
        (fewer outputs; requests must then not be aborted on an engine directly)."""
        self.engines = list(engines)
        self._fuse = fuse_decode
        self._fuse_until_submit = fuse_until_submit
        self._horizon = start_ms
        self.now_ms = start_ms
        """The virtual time; never decreases."""
        self.outcomes: list[RequestOutcome] = []
        """One entry per finished request, in finishing order."""
        self._on_step = on_step
        self._heap: list[tuple[float, int, int, bool]] = []
        self._order = itertools.count()
        self._wake = [math.inf] * len(self.engines)
        self._step_entry: list[tuple[float, int, int, bool] | None] = [None] * len(self.engines)
        """Each engine's heap entry for the end of its step in progress."""

    def add_engine(self, engine: Engine) -> int:
        """Add an engine at the current time (a replica that finished starting); returns its index.
        Engines are never removed: one that drained simply stays idle, which costs nothing."""
        self.engines.append(engine)
        self._wake.append(math.inf)
        self._step_entry.append(None)
        index = len(self.engines) - 1
        self._kick(index)
        return index

    def submit(
        self,
        engine_index: int,
        *,
        request_id: str,
        tokens: Sequence[int] | np.ndarray,
        max_tokens: int,
        block_hashes: tuple[list[int], list[int]] | None = None,
        transferred_first_token: int | None = None,
        adapter: str | None = None,
    ) -> Request:
        """Add a request to an engine at the current time (see :meth:`Engine.add_request`)."""
        engine = self.engines[engine_index]
        request = engine.add_request(
            request_id=request_id,
            tokens=tokens,
            max_tokens=max_tokens,
            now_ms=self.now_ms,
            block_hashes=block_hashes,
            transferred_first_token=transferred_first_token,
            adapter=adapter,
        )
        end = engine.cut_steps(self.now_ms)
        entry = self._step_entry[engine_index]
        if end is not None and entry is not None:
            heap = self._heap
            heap.remove(entry)
            heapq.heapify(heap)
            self._push_step_end(end, engine_index)
        self._kick(engine_index)
        return request

    def next_event_ms(self) -> float | None:
        """Time of the next step end or wake-up, ``None`` when every engine is idle."""
        return self._heap[0][0] if self._heap else None

    def run_until(self, t_ms: float) -> None:
        """Process every step end and wake-up up to ``t_ms``, then set the clock to ``t_ms``."""
        if t_ms < self.now_ms:
            raise ValueError(f"cannot run back in time to {t_ms} ms (now {self.now_ms} ms)")
        heap = self._heap
        engines = self.engines
        self._horizon = t_ms
        while heap and heap[0][0] <= t_ms:
            time, _, index, is_end = heapq.heappop(heap)
            self.now_ms = time
            if is_end:
                output = engines[index].end_step()
                if output.finished:
                    self.outcomes.extend(request.outcome() for request in output.finished)
                if self._on_step is not None:
                    self._on_step(index, output)
            elif self._wake[index] == time:
                self._wake[index] = math.inf
            self._kick(index)
        self.now_ms = t_ms

    def run(self) -> None:
        """Run until every engine is idle with nothing pending."""
        heap = self._heap
        while heap:
            self.run_until(max(time for time, _, _, _ in heap))

    def _kick(self, index: int) -> None:
        engine = self.engines[index]
        if engine.busy_until is not None:
            return
        horizon = (math.inf if self._fuse_until_submit else self._horizon) if self._fuse else None
        end = engine.begin_step(self.now_ms, horizon_ms=horizon)
        if end is not None:
            self._push_step_end(end, index)
            return
        wake = engine.next_wake_ms()
        if wake is not None and wake < self._wake[index]:
            self._wake[index] = wake
            heapq.heappush(self._heap, (max(wake, self.now_ms), next(self._order), index, False))

    def _push_step_end(self, end: float, index: int) -> None:
        entry = (end, next(self._order), index, True)
        self._step_entry[index] = entry
        heapq.heappush(self._heap, entry)
