"""The OpenAI-compatible HTTP surface of ``trtllm-serve`` that copse relies on.

Requests are validated the way ``trtllm-serve`` validates them, with one deliberate difference
in strictness: values must have the JSON type of their field (``"5"`` is not a valid
``max_tokens``, ``1.0`` is not a token id). Unknown fields are rejected with 400, as
``trtllm-serve`` does (its request models forbid extra fields). Inside a chat message unknown
keys are ignored (``trtllm-serve`` types messages as open dictionaries).

:func:`parse_request` turns a raw body into a request model or raises :class:`RequestError`,
whose message names the offending field (``prompt[3]``, ``messages[0].content``, ...); the
HTTP layer answers it as :class:`ErrorResponse` with status 400.

Disaggregated serving follows ``trtllm-serve``: a request with
``disaggregated_params.request_type == "context_only"`` is prefilled and returns one token plus
``disaggregated_params`` (``first_gen_tokens``, ``ctx_request_id``, ``encoded_opaque_state``);
the same prompt sent with those params and ``request_type == "generation_only"`` to a decode
engine continues from there.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from copse.workers.protocol.errors import ErrorResponse, RequestError
from copse.workers.protocol.limits import DEFAULT_LIMITS, RequestLimits, check_depth, check_request_limits

__all__ = ["ErrorResponse", "RequestError"]

DEFAULT_MAX_TOKENS = 32
"""Output length when a request sets none: TensorRT-LLM's ``SamplingParams`` default, what the
mocked engines generate and what the router predicts (``trtllm-serve`` itself generates up to the
rest of the context, ``max_seq_len`` minus the prompt, or until the model stops)."""

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
"""Chat roles accepted: OpenAI's (``function`` is its deprecated form of ``tool``). ``trtllm-serve``
types a message's role as any string and hands it to the chat template, whose models know these."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


TokenIds = Annotated[tuple[int, ...], PlainSerializer(list, return_type=list[int])]
"""Token ids a request carries, kept as a tuple (written as a JSON array): CPython's cycle
collector stops tracking a tuple of ints, so a process holding thousands of long prompts does not
walk every id at each full collection (with lists, a router holding 1,500 prompts of ~20k ids
stalled its event loop for 0.3-0.9 s at a time)."""


def _token_ids(value: object, *, field: str) -> TokenIds:
    if not isinstance(value, list | tuple):  # a list from JSON, a tuple from Python code
        raise ValueError(f"{field} must be a list of integer token ids, got {type(value).__name__}")
    # A prompt holds up to ~10^5 ids: check them with C loops first, and walk them one by one only
    # to name the first bad one (bool is not int for type(), so True/False fail here too).
    if not value or (set(map(type, value)) == {int} and min(value) >= 0 and max(value) < 2**32):
        return tuple(value)
    for i, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int):
            raise ValueError(f"{field}[{i}] must be an integer token id, got {token!r}")
        if not 0 <= token < 2**32:
            raise ValueError(f"{field}[{i}] must lie in [0, 2**32), got {token}")
    return tuple(value)


_UNHONOURED: dict[str, tuple[Any, str]] = {
    "best_of": (lambda v: v in (None, 1), "copse returns one sequence per request (best_of 1)"),
    "use_beam_search": (lambda v: not v, "beam search is not supported by copse"),
    "response_format": (
        lambda v: v is None or v.get("type") == "text",
        "structured output (json_object, json_schema) is not supported by copse; use type 'text'",
    ),
    "prompt_logprobs": (lambda v: not v, "logprobs are not supported by copse"),
    "top_logprobs": (lambda v: not v, "logprobs are not supported by copse"),
    "tools": (lambda v: not v, "tool calling is not supported by copse"),
    "tool_choice": (lambda v: v in (None, "none"), "tool calling is not supported by copse"),
}
"""Fields ``trtllm-serve`` accepts whose other values copse cannot honour: the values allowed, and
why the others are refused (a 400 naming the field, rather than an answer that ignores them)."""


def _refuse_unhonoured(field: str | None, value: Any) -> Any:
    assert field is not None
    allowed, why = _UNHONOURED[field]
    if not allowed(value):
        raise ValueError(why)
    return value


class StreamOptions(_Request):
    include_usage: bool = True
    """Send a last chunk with token counts (and no choices)."""
    continuous_usage_stats: bool = False
    """Attach token counts to every chunk."""


DisaggRequestType = Literal["context_only", "generation_only", "context_and_generation"]


class DisaggregatedParams(_Request):
    """``trtllm-serve``'s hand-over between a context (prefill) and a generation (decode) engine."""

    request_type: DisaggRequestType
    first_gen_tokens: TokenIds | None = None
    """Token(s) the context engine generated; the generation engine emits them first."""
    ctx_request_id: int | None = None
    """Id of the request on the context engine, to find its KV cache."""
    encoded_opaque_state: str | None = None
    """Engine-specific transfer state (the mocker stores where and how much KV to pull)."""
    draft_tokens: TokenIds | None = None
    disagg_request_id: int | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None

    @field_validator("first_gen_tokens", "draft_tokens", mode="plain")
    @classmethod
    def _check_tokens(cls, value: object) -> TokenIds | None:
        return None if value is None else _token_ids(value, field="token ids")


class LoraRequest(_Request):
    """The LoRA adapter a request is served through, as ``trtllm-serve`` takes it (its fields:
    ``tensorrt_llm/executor/request.py`` ``LoRARequest``; sent in the request body by
    ``examples/serve/openai_completion_client_for_lora.py``): ``trtllm-serve`` does not read
    ``model`` to choose an adapter."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int = Field(ge=0)
    """Key of the adapter in the engine's caches (copse sends
    :func:`~copse.workers.protocol.hashing.lora_int_id` of the name)."""
    lora_path: str = ""
    """Where the engine reads the adapter's weights (a path in the worker pod)."""


class _GenerationRequest(_Request):
    """Fields common to completions and chat completions. Sampling fields are accepted as
    ``trtllm-serve`` accepts them; a mocked engine generates without sampling, so they have no
    effect there."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=1)
    """Only one choice per request is supported."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    add_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    disaggregated_params: DisaggregatedParams | None = None
    lora_request: LoraRequest | None = None
    """The LoRA adapter to serve the request through (``None``: the base model, or the adapter
    ``model`` names where the server resolves adapter names)."""
    best_of: int | None = None
    """Accepted as 1 (or null) only: copse streams one sequence per request."""
    use_beam_search: bool = False
    """Accepted as false only: beam search returns several sequences."""
    response_format: dict[str, Any] | None = None
    """Accepted as ``{"type": "text"}`` (or null) only: structured output needs the engine's
    guided decoding, which the token-id requests the router sends cannot ask for."""
    prompt_logprobs: int | None = None
    """Accepted as 0 (or null) only, like ``logprobs``."""

    @field_validator("best_of", "use_beam_search", "response_format", "prompt_logprobs", mode="after")
    @classmethod
    def _honoured(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unhonoured(info.field_name, value)

    @field_validator("stop", mode="plain")
    @classmethod
    def _check_stop(cls, value: object) -> str | list[str] | None:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return value
        raise ValueError("stop must be a string or a list of strings")

    @field_validator("stop_token_ids", mode="plain")
    @classmethod
    def _check_stop_token_ids(cls, value: object) -> TokenIds | None:
        return None if value is None else _token_ids(value, field="stop_token_ids")

    def asked_tokens(self) -> int | None:
        """The output length the request sets, if it sets one."""
        return self.max_tokens

    def requested_tokens(self) -> int:
        """Tokens to generate (``max_tokens`` or the default)."""
        asked = self.asked_tokens()
        return asked if asked is not None else DEFAULT_MAX_TOKENS


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: one prompt, as text or as token ids."""

    prompt: str | TokenIds
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    detokenize: bool = True
    """``false``: chunks carry the output ``token_ids`` and an empty ``text`` (``trtllm-serve``'s
    ``SamplingParams.detokenize``; its stop strings then match token ids only)."""

    @field_validator("prompt", mode="plain")
    @classmethod
    def _check_prompt(cls, value: object) -> str | TokenIds:
        if isinstance(value, str):
            if not value:
                raise ValueError("prompt must not be empty")
            return value
        if isinstance(value, list) and value and all(isinstance(item, str | list) for item in value):
            raise ValueError("batched prompts (a list of strings or of token lists) are not supported")
        tokens = _token_ids(value, field="prompt")
        if not tokens:
            raise ValueError("prompt must not be empty")
        return tokens

    @field_validator("logprobs", mode="after")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise ValueError("logprobs is not supported")
        return value

    @field_validator("suffix", mode="after")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value


class TextPart(BaseModel):
    """A text part of a chat message's content."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; content is a string, a list of text parts, or null."""

    model_config = ConfigDict(extra="ignore", strict=True)
    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None

    @field_validator("role", mode="after")
    @classmethod
    def _known_role(cls, value: str) -> str:
        if value not in ROLES:
            raise ValueError(f"role must be one of {', '.join(sorted(ROLES))}")
        return value

    @field_validator("content", mode="plain")
    @classmethod
    def _check_content(cls, value: object) -> str | list[TextPart] | None:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(f"content must be a string or a list of text parts, got {type(value).__name__}")
        parts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(
                    f"content[{i}]: parts of type {kind[:40]!r} are not supported by copse, which "
                    "routes by the prompt's tokens and tokenizes text only (send type 'text')"
                )
            if not (isinstance(part, dict) and kind == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"content[{i}] must be {{'type': 'text', 'text': <string>}}")
            parts.append(TextPart(type="text", text=part["text"]))
        return parts

    def text(self) -> str:
        """The message content as plain text: text parts joined with newlines, as ``trtllm-serve``
        flattens them before its chat template sees them (``serve/chat_utils.py``
        ``parse_chat_message_content_parts``); no content is the empty string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``. The chat-template fields and their defaults are
    ``trtllm-serve``'s (``serve/openai_protocol.py``): the generation prompt is added, and no
    special tokens are added on top of what the template renders."""

    messages: list[ChatMessage] = Field(min_length=1)
    prompt_token_ids: TokenIds | None = None
    """The rendered and tokenized chat, used instead of rendering ``messages`` (``trtllm-serve`` uses
    it for generation requests in disaggregated serving; the router to continue a migrated chat)."""
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    """Render the header of the assistant's turn after the messages."""
    echo: bool = False
    """Put the last message's text in front of the answer when that message has the answer's role
    (``trtllm-serve``'s and vLLM's extra parameter: continuing a started assistant turn)."""
    add_special_tokens: bool = False
    """Add the tokenizer's special tokens (e.g. BOS) on top of what the chat template renders."""
    chat_template: str | None = None
    """A Jinja template (or the name of one of the model's templates) replacing the model's own."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (they override the special tokens of the same name)."""
    documents: list[dict[str, str]] | None = None
    """Documents the template may render (retrieval-augmented generation)."""
    tools: list[dict[str, Any]] | None = None
    """Accepted empty (or null) only: tool calling needs the tools rendered by the chat template
    and the calls parsed from the output, neither of which copse does."""
    tool_choice: str | dict[str, Any] | None = None
    """Accepted as ``"none"`` (or null) only, as ``tools``."""

    @field_validator("tools", "tool_choice", "top_logprobs", mode="after")
    @classmethod
    def _honoured_in_chat(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unhonoured(info.field_name, value)

    @field_validator("logprobs", mode="after")
    @classmethod
    def _no_logprobs(cls, value: bool) -> bool:
        if value:
            raise ValueError("logprobs is not supported")
        return value

    @field_validator("prompt_token_ids", mode="plain")
    @classmethod
    def _check_prompt_token_ids(cls, value: object) -> TokenIds | None:
        if value is None:
            return None
        tokens = _token_ids(value, field="prompt_token_ids")
        if not tokens:
            raise ValueError("prompt_token_ids must not be empty")
        return tokens

    def turns(self) -> list[tuple[str, str]]:
        """``(role, text)`` of every message, as a chat template renders them."""
        return [(message.role, message.text()) for message in self.messages]

    def asked_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


_RequestT = TypeVar("_RequestT", bound=_Request)


def _field_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path


def _describe(error: Any) -> tuple[str, str]:
    path = _field_path(tuple(error["loc"]))
    kind = error["type"]
    if kind == "missing":
        return path, f"{path}: field required"
    if kind == "extra_forbidden":
        return path, f"{path}: unknown field (trtllm-serve accepts only the fields of its OpenAI schema)"
    message = str(error["msg"]).removeprefix("Value error, ")
    got = repr(error.get("input"))
    if len(got) > 60:
        got = got[:57] + "..."
    return path, f"{path}: {message} (got {got})" if path else message


def parse_request(
    model: type[_RequestT], body: bytes, *, limits: RequestLimits = DEFAULT_LIMITS
) -> _RequestT:
    """Validate a raw JSON body; raises :class:`RequestError` naming the first bad field or the
    limit (:mod:`copse.workers.protocol.limits`) it breaks."""
    return parse_request_object(model, body, limits=limits)[0]


def parse_request_object(
    model: type[_RequestT], body: bytes, *, limits: RequestLimits = DEFAULT_LIMITS
) -> tuple[_RequestT, dict[str, Any]]:
    """:func:`parse_request`, also returning the JSON object the body holds (for a proxy that
    forwards it: one decode of a long prompt instead of two). The body's nesting and size of each
    part are checked before the JSON is decoded and before the request model is built."""
    check_depth(body, limits)
    try:
        raw = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # max_json_depth above the parser's recursion limit
        raise RequestError("request body is nested deeper than the JSON parser allows") from exc
    if not isinstance(raw, dict):
        raise RequestError(f"request body must be a JSON object, got {type(raw).__name__}")
    check_request_limits(raw, limits)
    if raw.get("stream_options") is not None and not raw.get("stream"):
        raise RequestError("stream_options: only allowed when stream is true", param="stream_options")
    try:
        parsed = model.model_validate(raw)
    except ValidationError as exc:
        path, message = _describe(exc.errors()[0])
        raise RequestError(message, param=path or None) from exc
    for key in ("prompt", "prompt_token_ids"):  # the object shares the model's tuple (see TokenIds)
        value = getattr(parsed, key, None)
        if isinstance(value, tuple):
            raw[key] = value
    return parsed, raw


# Responses ----------------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


def new_completion_id() -> str:
    """A fresh completion id (``cmpl-...``)."""
    return f"cmpl-{uuid.uuid4().hex}"


def new_chat_id() -> str:
    """A fresh chat completion id (``chatcmpl-...``)."""
    return f"chatcmpl-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


FinishReason = Literal["stop", "length", "abort"]


class CompletionChoice(_Response):
    index: int = 0
    text: str
    token_ids: list[int] | None = None
    finish_reason: FinishReason | None = None
    disaggregated_params: DisaggregatedParams | None = None


class CompletionResponse(_Response):
    id: str = Field(default_factory=new_completion_id)
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None


class CompletionStreamChoice(_Response):
    index: int = 0
    text: str
    token_ids: list[int] | None = None
    finish_reason: FinishReason | None = None


class CompletionStreamResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Response):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason | None = None
    disaggregated_params: DisaggregatedParams | None = None


class ChatCompletionResponse(_Response):
    id: str = Field(default_factory=new_chat_id)
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(_Response):
    index: int = 0
    delta: DeltaMessage
    token_ids: list[int] | None = None
    """The chunk's output token ids. A copse mocker extension: ``trtllm-serve`` streams no token ids
    in chat chunks (the router sends it a chat as a token-id completions request instead; see
    :mod:`copse.router.token_streams`)."""
    finish_reason: FinishReason | None = None


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
