"""What every copse HTTP server (router, mocked engine, KV relay) shares at its edge: error
answers in the one error shape (:mod:`copse.workers.protocol.errors`), and a middleware that turns
whatever aiohttp or a handler raises (an unknown path, a wrong method, a body over the size limit,
a bug) into such an answer: no client ever gets aiohttp's plain-text pages, and nothing a client
sends makes a 5xx other than the server's own ``503``/``502`` answers; and the cycle collector's
settings of a process serving thousands of streams (:func:`tune_collector`).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from copse.workers.protocol.errors import error_body

log = logging.getLogger(__name__)

YOUNG_COLLECTION_ALLOCATIONS = 20_000
"""Allocations between two young collections of CPython's cycle collector (its default is 700). A
process relaying thousands of streams allocates objects that live across an ``await`` (a parsed
chunk, a pending write); collected every 700 allocations, they survive into the old generations,
whose full collections then come every two seconds and walk every stream's objects: a router
relaying 1,500 streams stalled 0.3-0.5 s each time, every stream and decision with it. At 20,000
most die young, and a young collection still takes a few milliseconds."""

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
"""Largest request body read by default: long-context and agentic prompts run to tens of MB (a
1M-token chat is ~5 MB of text)."""


def tune_collector() -> None:
    """Set the cycle collector for serving (call once started, before the first request): what
    start-up built (modules, schemas, config) is frozen out of every later collection, and young
    objects are collected every :data:`YOUNG_COLLECTION_ALLOCATIONS` allocations."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_ALLOCATIONS, middle, old)


def error_response(
    status: int, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    """An error answer in the one error shape."""
    return web.json_response(
        text=error_body(status, message, param=param).decode(), status=status, headers=headers
    )


def openai_errors(
    *, max_body_bytes: int, on_error: Callable[[web.Request, int], None] | None = None
) -> Middleware:
    """A middleware answering aiohttp's errors (404, 405, 413, ...) and any exception a handler
    lets escape in the one error shape; ``on_error(request, status)`` counts them."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = (
                f"request body over {max_body_bytes} bytes (max_body_bytes)"
                if exc.status == 413
                else f"{exc.reason}: {request.method} {request.path}"
            )
            status = exc.status
        except (ConnectionError, TimeoutError):
            raise  # the client went away or stalled: nobody to answer
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            status, message = 500, f"internal error serving {request.method} {request.path}"
        if on_error is not None:
            on_error(request, status)
        return error_response(status, message)

    return middleware
