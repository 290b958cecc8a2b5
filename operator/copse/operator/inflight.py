"""How many requests a draining group still serves: asked from the routers in front of it.

Why the routers and not the engines: a router counts a request from the moment it picks a
worker until the stream ends, so nothing is on the wire that it does not see (an engine's own
gauge misses a request the router has sent but the engine not yet admitted), and it is the same
component that stopped sending the group new work. ``trtllm-serve``'s
``trtllm_num_requests_running``/``_waiting`` gauges also exist only with ``return_perf_metrics``
and ``enable_iter_perf_stats``, and are iteration statistics refreshed when requests complete,
so an engine that went idle keeps showing its last busy iteration. Requests sent to an engine
directly, bypassing the router, are not seen; the pods' termination grace still covers them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import aiohttp

logger = logging.getLogger("copse.operator")

TIMEOUT_S = 2.0
"""A router that does not answer this fast counts as unknown (the group keeps draining)."""


class InFlight(Protocol):
    """Counts, for each worker pod, the requests the given routers still have on it."""

    async def count(self, *, routers: Sequence[str], workers: Sequence[str]) -> dict[str, int | None]:
        """``routers``: base URLs of the ready router pods; ``workers``: rank-0 pod names.
        ``None`` for a worker when some router could not say, or has not seen it draining yet."""
        ...

    async def unlisted(self, *, routers: Sequence[str], workers: Sequence[str]) -> set[str]:
        """Those of ``workers`` (rank-0 pod names) that some router does not use yet (it lists
        them not, or as draining); a router that does not answer is left out."""
        ...


def unused(reports: Sequence[Sequence[Mapping[str, Any]] | None], workers: Sequence[str]) -> set[str]:
    """The workers some answering router does not list as usable (``GET /workers`` lists the
    workers a router has probed healthy; a draining one gets no new requests)."""
    missing: set[str] = set()
    for report in reports:
        if report is None:
            continue
        usable = {str(entry.get("key")) for entry in report if not entry.get("draining")}
        missing.update(worker for worker in workers if worker not in usable)
    return missing


def tally(
    reports: Sequence[Sequence[Mapping[str, Any]] | None], workers: Sequence[str]
) -> dict[str, int | None]:
    """Sum the routers' ``GET /workers`` reports (``None``: a router that did not answer).

    A worker a router does not list gets nothing from it (0); one it lists but not as draining
    may still get new requests, so its count is not known to be final (None)."""
    counts: dict[str, int | None] = dict.fromkeys(workers, 0)
    for report in reports:
        listed = {} if report is None else {str(entry.get("key")): entry for entry in report}
        for worker in workers:
            entry = listed.get(worker)
            total = counts[worker]
            if report is None or (entry is not None and not entry.get("draining")):
                counts[worker] = None
            elif entry is not None and total is not None:
                counts[worker] = total + int(entry.get("in_flight", 0))
    return counts


class RouterInFlight:
    """:class:`InFlight` over HTTP: ``GET <router>/workers`` on every router pod."""

    async def count(self, *, routers: Sequence[str], workers: Sequence[str]) -> dict[str, int | None]:
        if not workers:
            return {}
        return tally(await self._reports(routers), workers)

    async def unlisted(self, *, routers: Sequence[str], workers: Sequence[str]) -> set[str]:
        if not workers or not routers:
            return set()
        return unused(await self._reports(routers), workers)

    async def _reports(self, routers: Sequence[str]) -> list[list[dict[str, Any]] | None]:
        timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return list(await asyncio.gather(*(self._report(session, router) for router in routers)))

    async def _report(self, session: aiohttp.ClientSession, router: str) -> list[dict[str, Any]] | None:
        try:
            async with session.get(f"{router}/workers") as response:
                response.raise_for_status()
                body = await response.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            logger.warning("cannot count in-flight requests at router %s: %s", router, exc)
            return None
        workers = body.get("workers") if isinstance(body, dict) else None
        return workers if isinstance(workers, list) else None
