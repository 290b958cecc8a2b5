"""The one error body of every copse server: OpenAI's ``{"error": {"message", "type", "param",
"code"}}`` (as vLLM answers it: ``code`` is the HTTP status), for HTTP answers and for the
``data: {"error": ...}`` event that ends a failed stream alike.

``trtllm-serve`` answers errors in a flat shape (``{"object": "error", "message", ...}``); the
router rewrites a worker's error into this one (:func:`as_openai_error`) so that a client sees one
shape whichever component refused its request.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict


class RequestError(ValueError):
    """A request that cannot be served as sent (HTTP 400); ``param`` names the field when known."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}
"""Error ``type`` of each HTTP status a copse server answers with."""


class ErrorDetail(BaseModel):
    """What went wrong: ``param`` names the request field at fault when there is one."""

    model_config = ConfigDict(extra="forbid")
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Body of every 4xx/5xx answer, and of the error event that ends a failed stream."""

    model_config = ConfigDict(extra="forbid")
    error: ErrorDetail


def error_detail(status: int, message: str, *, param: str | None = None) -> ErrorDetail:
    """The error of ``status`` (its type from :data:`ERROR_TYPES`)."""
    return ErrorDetail(message=message, type=ERROR_TYPES.get(status, "Error"), param=param, code=status)


def error_body(status: int, message: str, *, param: str | None = None) -> bytes:
    """An error answer's JSON body."""
    return ErrorResponse(error=error_detail(status, message, param=param)).model_dump_json().encode()


def error_event(status: int, message: str, *, param: str | None = None) -> bytes:
    """The SSE event that ends a stream with an error (the same body as an HTTP error)."""
    return b"data: " + error_body(status, message, param=param) + b"\n\n"


def as_openai_error(body: bytes, *, status: int) -> bytes:
    """A worker's error answer in the one error shape: an OpenAI-shaped body passes as it is, a
    flat one (``trtllm-serve``'s ``{"object": "error", "message", "type", "param", "code"}``) is
    wrapped, anything else (plain text, a proxy's HTML page) becomes the message."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        parsed = None
    if isinstance(parsed, dict):
        inner = parsed.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return body
        if isinstance(parsed.get("message"), str):
            param = parsed.get("param")
            kind = parsed.get("type")
            detail = ErrorDetail(
                message=parsed["message"],
                type=kind if isinstance(kind, str) else ERROR_TYPES.get(status, "Error"),
                param=param if isinstance(param, str) else None,
                code=status,
            )
            return ErrorResponse(error=detail).model_dump_json().encode()
    text = body.decode("utf-8", errors="replace").strip()[:500] or f"HTTP {status}"
    return error_body(status, text)
