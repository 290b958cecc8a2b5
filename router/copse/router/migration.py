"""Request migration: a stream whose worker fails after its first token goes on on another worker.

The router records the output token ids every streamed chunk carries. When the stream breaks, the
continuation is the original prompt's token ids followed by the ids already streamed, with
``max_tokens`` (and ``min_tokens``) reduced by their count and every other setting unchanged: a
completions request with that token-id prompt, or a chat request with it as ``prompt_token_ids``
(which ``trtllm-serve`` uses instead of rendering the messages). Token ids are carried over, never
text: re-tokenizing text can give other ids than the model generated. The continuation is routed
like a new request (so the KV-aware choice counts the prefix a worker already holds, and in
disaggregated serving it is prefilled again), and its chunks reach the client under the first
stream's id and creation time, without a second chat role header, with usage counted as the
client sees it (prompt: the original prompt; completion: every token it received).

A stream can be continued only while each of its output chunks carried token ids (copse's mocked
engines send them in completions and chat chunks; ``trtllm-serve`` only in completions with
``detokenize: false``, never in chat: :mod:`copse.router.token_streams` streams from it in token
ids, and matches stop strings split across a break, for the router). What a continuation cannot
reproduce: presence/frequency penalties no longer count the carried tokens, and a seeded sampler
restarts its random sequence.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from copse.workers.protocol.openai_api import TokenIds


class MigrationReason(enum.StrEnum):
    """Why a stream left its worker (the ``reason`` label of the migration metric)."""

    DISCONNECTED = "disconnected"
    """The connection to the worker broke (its process died, or the connection was reset)."""
    ENDED_EARLY = "ended_early"
    """The worker closed the stream before finishing it."""
    WORKER_ERROR = "worker_error"
    """The worker sent an error event in the middle of the stream."""
    WORKER_LOST = "worker_lost"
    """Health probes dropped the worker (it stopped answering: hung, or unreachable)."""
    TIMEOUT = "timeout"
    """The stream stayed silent for longer than the token timeout."""


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclasses.dataclass(slots=True)
class StreamProgress:
    """What a streamed request has delivered to its client, across the workers that served it."""

    prompt: TokenIds
    """Token ids of the original prompt."""
    requested: int
    """Output tokens the client asked for (``max_tokens``, or the default)."""
    output: list[int] = dataclasses.field(default_factory=list)
    """Output token ids the client received (each attempt's stream meter appends to it)."""
    trackable: bool = True
    """Every output chunk so far carried its token ids (else the stream cannot be continued)."""
    finished: bool = False
    """A chunk carried a ``finish_reason``: nothing is left to generate."""
    stream_id: str | None = None
    """``id`` of the first chunk the client received; continuations keep it."""
    created: int | None = None
    """``created`` of that chunk."""
    carried: int = 0
    """Output tokens carried into the prompt of the attempt in progress (0 for the first)."""
    migrations: int = 0
    """Times the stream moved to another worker."""

    @property
    def remaining(self) -> int:
        """Output tokens still to generate."""
        return self.requested - len(self.output)

    @property
    def continued_prompt(self) -> TokenIds:
        """The prompt of a continuation: the original prompt and the output the client received."""
        return (*self.prompt, *self.output)

    @property
    def resumable(self) -> bool:
        """Whether the stream can go on elsewhere (it knows its ids and has something left)."""
        return self.trackable and not self.finished and self.remaining > 0

    def note_first(self, event: Mapping[str, Any]) -> None:
        """The first output chunk the client gets: continuations keep its ``id`` and ``created``."""
        stream_id = event.get("id")
        self.stream_id = stream_id if isinstance(stream_id, str) else None
        self.created = _int(event.get("created"))

    def absorb(self, *, untracked: bool, finished: bool) -> None:
        """What an attempt's stream showed (its token ids are in :attr:`output` already)."""
        self.trackable = self.trackable and not untracked
        self.finished = self.finished or finished

    def continuation(self, payload: Mapping[str, Any], *, chat: bool) -> dict[str, Any]:
        """The request that continues the stream on another worker (``payload``: the client's)."""
        body = dict(payload)
        ids = self.continued_prompt
        remaining = self.remaining
        body.pop("echo", None)  # the client has its prompt (or last message) echoed already
        if chat:
            body["prompt_token_ids"] = ids
            keys = [key for key in ("max_tokens", "max_completion_tokens") if key in body]
        else:
            body["prompt"] = ids
            keys = ["max_tokens"]
        for key in keys or ["max_tokens"]:
            body[key] = remaining
        min_tokens = _int(body.get("min_tokens"))
        if min_tokens:
            body["min_tokens"] = max(0, min_tokens - len(self.output))
        return body

    def start_attempt(self) -> None:
        """A continuation goes out: the tokens so far become part of its prompt."""
        self.carried = len(self.output)
        self.migrations += 1

    def rewrite(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """A chunk of a continuation as the client must see it; ``None`` for one to drop (the
        second chat role header)."""
        if self.stream_id is not None:
            event["id"] = self.stream_id
        if self.created is not None:
            event["created"] = self.created
        choices = event.get("choices")
        if choices:
            kept = []
            for choice in choices:
                delta = choice.get("delta")
                header = isinstance(delta, dict) and delta.pop("role", None) is not None
                if header and not delta.get("content") and not choice.get("finish_reason"):
                    continue  # the client had its role header from the first worker
                kept.append(choice)
            if not kept:
                return None
            event["choices"] = kept
        usage = event.get("usage")
        if isinstance(usage, dict):
            self._client_usage(usage)
        return event

    def _client_usage(self, usage: dict[str, Any]) -> None:
        prompt = _int(usage.get("prompt_tokens"))
        completion = _int(usage.get("completion_tokens"))
        if prompt is None or completion is None:
            return
        usage["prompt_tokens"] = prompt - self.carried
        usage["completion_tokens"] = completion + self.carried
        details = usage.get("prompt_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
        if cached is not None and isinstance(details, dict):
            details["cached_tokens"] = min(cached, prompt - self.carried)
