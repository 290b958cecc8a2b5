"""Bounds on what one request may ask for, checked before anything is allocated for it.

Every server that reads OpenAI requests (the router over HTTP and as an endpoint picker, the
mocked engines) checks the same limits, so that no number or size a client chooses makes a
process allocate in proportion to it:

- the body: its size (the HTTP layer's ``max_body_bytes``) and its JSON nesting depth, measured
  on the raw bytes before the JSON parser (whose recursion would otherwise fail deep inside);
- the request: messages, content parts, the length of each text, stop strings, ``logit_bias``
  entries and stop token ids (:func:`check_request_limits`);
- the context: ``max_tokens`` alone (before tokenizing) and prompt plus ``max_tokens`` (after)
  against the model's context (:func:`check_context`).

Each breach is a :class:`~copse.workers.protocol.openai_api.RequestError` (HTTP 400) whose message
names the limit, its value and the setting that changes it.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from copse.workers.protocol.errors import RequestError

DEFAULT_CONTEXT_TOKENS = 131072
"""Context of the engines when nothing says otherwise (Llama 3.x, and the mocker's default)."""

_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
"""A JSON string literal (its brackets are not structure); written unrolled, so that the regex
engine runs through a string's plain characters in one tight loop."""
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_CHUNK = 1 << 20
"""Brackets measured at a time (a body of brackets only costs 5 MiB of arrays, not 9x its size)."""


class RequestLimits(BaseModel):
    """What one request may hold; the defaults admit every real chat and prompt (a 1M-token
    context is ~5 MB of text) and stop what only an attack or a bug would send."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_json_depth: int = Field(default=64, ge=4)
    """Deepest nesting of arrays and objects in a body: an OpenAI request needs about 6 (a chat
    with tool schemas a dozen or two); thousands only exhaust the parser's recursion."""
    max_json_containers: int = Field(default=100_000, ge=16)
    """Arrays and objects in a body: each costs the parser ~100 bytes of memory for 2 bytes of
    body (``[{},{},...]``), so their count, not the body size, bounds what parsing holds."""
    max_messages: int = Field(default=16384, ge=1)
    """Messages in one chat: far beyond any conversation that fits a context window."""
    max_content_parts: int = Field(default=4096, ge=1)
    """Content parts in one message."""
    max_string_chars: int = Field(default=16 * 1024 * 1024, ge=1024)
    """Characters in one text (a prompt, a message's content or text part): 16 Mi characters is
    several million tokens, more than any context."""
    max_stop: int = Field(default=64, ge=1)
    """Stop strings (and, separately, stop token ids) in one request: each is matched against every
    output token, so the count is per-token work."""
    max_stop_chars: int = Field(default=4096, ge=1)
    """Characters in one stop string."""
    max_logit_bias: int = Field(default=1024, ge=1)
    """Entries of ``logit_bias``."""


DEFAULT_LIMITS = RequestLimits()


def json_shape(
    body: bytes, *, max_depth: int | None = None, max_containers: int | None = None
) -> tuple[int, int]:
    """The deepest nesting of arrays and objects in a JSON text and how many there are, counted on
    the bytes (string literals, which may hold brackets, are skipped) with C loops and bounded
    memory, whatever the text's size; the count stops early once past ``max_depth`` or
    ``max_containers`` (what it returns then is past the limit, not the whole count)."""
    brackets = _STRINGS.sub(b"", body).translate(None, _NOT_BRACKETS)
    depth = deepest = opened = 0
    for start in range(0, len(brackets), _CHUNK):
        count = min(_CHUNK, len(brackets) - start)
        steps = _STEP[np.frombuffer(brackets, dtype=np.uint8, count=count, offset=start)]
        opened += int(np.count_nonzero(steps == 1))
        levels = np.cumsum(steps, dtype=np.int32)
        deepest = max(deepest, depth + int(levels.max()))
        depth += int(levels[-1])
        if deepest > (max_depth or deepest) or opened > (max_containers or opened):
            break
    return deepest, opened


def check_depth(body: bytes, limits: RequestLimits) -> None:
    """Raise :class:`RequestError` for a body nested deeper than ``limits.max_json_depth`` or
    holding more than ``limits.max_json_containers`` arrays and objects (before it is parsed). A
    body with few bracket characters anywhere cannot break either and is not scanned further."""
    if body.count(b"[") + body.count(b"{") <= min(limits.max_json_depth, limits.max_json_containers):
        return
    depth, containers = json_shape(
        body, max_depth=limits.max_json_depth, max_containers=limits.max_json_containers
    )
    if depth > limits.max_json_depth:
        raise RequestError(
            f"request body is nested more than {limits.max_json_depth} levels deep (max_json_depth)"
        )
    if containers > limits.max_json_containers:
        raise RequestError(
            f"request body holds more than {limits.max_json_containers} arrays and objects "
            "(max_json_containers)"
        )


def check_request_limits(raw: dict[str, Any], limits: RequestLimits) -> None:
    """Raise :class:`RequestError` for a parsed request body holding more than ``limits`` allow
    (before the request model is built from it). Values of the wrong type are left to the model's
    validation, which names them."""
    _text(raw.get("prompt"), limits, param="prompt")
    messages = raw.get("messages")
    if isinstance(messages, list):
        _bound(limits, "max_messages", what="messages", count=len(messages), param="messages")
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            where = f"messages[{i}].content"
            if not isinstance(content, list):
                _text(content, limits, param=where)
                continue
            _bound(limits, "max_content_parts", what="content parts", count=len(content), param=where)
            for j, part in enumerate(content):
                if isinstance(part, dict):
                    _text(part.get("text"), limits, param=f"{where}[{j}].text")
    stop = raw.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    _bound(limits, "max_stop", what="stop strings", count=len(stops), param="stop")
    for i, text in enumerate(stops):
        if isinstance(text, str):
            _bound(
                limits,
                "max_stop_chars",
                what="characters in a stop string",
                count=len(text),
                param=f"stop[{i}]",
            )
    ids = raw.get("stop_token_ids")
    if isinstance(ids, list):
        _bound(limits, "max_stop", what="stop token ids", count=len(ids), param="stop_token_ids")
    bias = raw.get("logit_bias")
    if isinstance(bias, dict):
        _bound(limits, "max_logit_bias", what="logit_bias entries", count=len(bias), param="logit_bias")


def _bound(limits: RequestLimits, setting: str, *, what: str, count: int, param: str) -> None:
    """Raise :class:`RequestError` when ``count`` passes the limit ``setting`` of ``limits``."""
    limit = getattr(limits, setting)
    if count > limit:
        raise RequestError(f"{what}: {count}, more than the limit of {limit} ({setting})", param=param)


def _text(value: object, limits: RequestLimits, *, param: str) -> None:
    if isinstance(value, str):
        _bound(limits, "max_string_chars", what="characters", count=len(value), param=param)


def check_context(*, prompt_tokens: int | None, max_tokens: int | None, context: int) -> None:
    """Raise :class:`RequestError` when a request cannot fit the model's context: ``max_tokens``
    alone (``prompt_tokens`` None: before tokenizing) or prompt plus ``max_tokens``. A request
    without ``max_tokens`` only needs its prompt to fit, leaving at least one token of room."""
    if max_tokens is not None and max_tokens >= context:
        raise RequestError(
            f"max_tokens ({max_tokens}) leaves no room for a prompt in this model's context of "
            f"{context} tokens",
            param="max_tokens",
        )
    if prompt_tokens is None:
        return
    if prompt_tokens >= context:
        raise RequestError(
            f"prompt has {prompt_tokens} tokens; this model's context is {context} tokens",
            param="prompt",
        )
    if max_tokens is not None and prompt_tokens + max_tokens > context:
        raise RequestError(
            f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds this model's "
            f"context of {context} tokens",
            param="max_tokens",
        )
