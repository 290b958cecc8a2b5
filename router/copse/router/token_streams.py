"""Streams from a real ``trtllm-serve`` in token ids, to the client in text: what makes them migratable.

A stream can move to another worker only if the router knows the token ids already streamed
(:mod:`copse.router.migration`). What ``trtllm-serve`` streams, read in TensorRT-LLM's sources
(``serve/openai_protocol.py``, ``serve/postprocess_handlers.py``, ``serve/openai_server.py``,
``executor/result.py``, ``sampling_params.py``, ``tokenizer/tokenizer.py``, PyTorch
``sampler.py``) and never run against a real engine:

* Completions chunks carry ``token_ids`` only when the request sets ``detokenize: false``, and then
  an empty ``text``; chat chunks never carry token ids; an unknown request field is a 400.
* Stop strings with ``detokenize: false``: ``SamplingParams._setup`` encodes each one
  (``tokenizer.encode(stop, add_special_tokens=False)``), the sampler stops when the request's last
  tokens (prompt and output together) equal one, and ``GenerationResultBase._handle_sequence``
  then removes those ids from the output's end (unless ``include_stop_str_in_output``), with
  ``stop_reason`` naming the string: ids already streamed stay streamed. The check that a stop
  string appears in the *decoded text* (which also catches a string the model spelled with other
  tokens) runs in ``DetokenizedGenerationResultBase`` only when ``detokenize`` is true: it cuts the
  text at the string's first occurrence (keeping it with ``include_stop_str_in_output``), finishes
  with ``stop`` and aborts the request.
* The text of a stream: ``hf_decode_incrementally`` (see :class:`~copse.router.tokens.StreamDecoder`).

So for ``engine: trtllm`` the router sends a streamed request as a token-id completions request
with ``detokenize: false`` and does the rest itself, as the engine would have with ``detokenize``
true: it decodes the ids (:class:`OutputText`), cuts at stop strings found in the text (and then
stops reading the engine, which aborts the request when its connection closes), and writes the
chunks the client asked for (:class:`TokenRelay`):

* completions: the engine's chunk with the decoded ``text`` (the prompt in front of the first one
  with ``echo``) and ``token_ids: null``;
* chat: rendered by the router's chat template (the exact prompt ids it hashes), sent as a
  completions request, and answered in chat chunks: the role header once (``assistant``, or the
  last message's role without ``add_generation_prompt``), with ``echo`` the last message's text
  in a chunk of its own, ``delta.content``, ``finish_reason`` and ``stop_reason``, the usage chunk;
  ids ``chatcmpl-...``.

``echo`` is not sent to the engine (with ``detokenize: false`` its echoed text is dropped with the
rest, and a token-id prompt makes its post-processor fail); the router writes it (:func:`echoed`).

After a migration the continuation's engine sees the streamed ids as prompt. Its sampler still
stops on a stop word split across the break (it compares the request's last tokens), but its
``_handle_sequence`` only looks at its own output, so it neither names nor removes the word:
:class:`OutputText` does both over the whole output, as the first engine would have. The text-level
match runs on the whole text, so a stop string split across the break is found as well.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from copse.router.migration import StreamProgress
from copse.router.tokens import HfPromptTokenizer, StreamDecoder
from copse.workers.protocol.openai_api import ChatCompletionRequest, CompletionRequest, TokenIds

ENGINE_PATH = "/v1/completions"
"""Where a relayed stream goes: chat too is sent as a token-id completions request."""

_CHAT_ONLY_FIELDS = frozenset(ChatCompletionRequest.model_fields) - frozenset(CompletionRequest.model_fields)
"""Fields of a chat request that a completions request does not take (messages, chat template...)."""


@dataclasses.dataclass(frozen=True, slots=True)
class StopConditions:
    """A request's stop conditions as ``trtllm-serve``'s ``SamplingParams`` holds them."""

    words: tuple[tuple[str | int, tuple[int, ...]], ...]
    """``(reason, token ids)`` in ``_get_stop_reasons_and_words`` order: each of ``stop_token_ids``,
    then each stop string with its encoding."""
    strings: tuple[str, ...]
    """The stop strings, in the request's order (what the decoded text is searched for)."""
    include: bool
    """``include_stop_str_in_output``."""

    @classmethod
    def of(
        cls, request: CompletionRequest | ChatCompletionRequest, tokenizer: HfPromptTokenizer
    ) -> StopConditions:
        strings = tuple([request.stop] if isinstance(request.stop, str) else request.stop or ())
        words: list[tuple[str | int, tuple[int, ...]]] = [
            (token, (token,)) for token in request.stop_token_ids or ()
        ]
        words += [(text, tuple(tokenizer.stop_ids(text))) for text in strings]
        return cls(
            words=tuple((reason, ids) for reason, ids in words if ids),
            strings=strings,
            include=request.include_stop_str_in_output,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """What one engine chunk adds to the client's output."""

    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    stopped: bool
    """The router found a stop string the engine did not stop on: the stream ends here."""
    trimmed: int
    """Output tokens the router removed (a stop word split across a migration)."""


class OutputText:
    """The text ``trtllm-serve`` would stream for one output's token ids (``detokenize`` true),
    across the workers that generate them."""

    def __init__(self, decoder: StreamDecoder, stops: StopConditions) -> None:
        self._decoder = decoder
        self._stops = stops
        self.ids: list[int] = []
        """The output's token ids as the engine's result holds them (after a stop word's removal)."""
        self.text = ""
        """The output's text so far (``CompletionOutput.text``)."""

    def feed(
        self, ids: list[int], *, finish_reason: str | None, stop_reason: str | int | None, resumed: bool
    ) -> Step:
        """Account one engine chunk (``resumed``: from a continuation, not the first worker)."""
        known = len(self.ids)
        self.ids.extend(ids)
        trimmed = 0
        if resumed and finish_reason == "stop" and stop_reason is None:
            # The continuation's sampler stopped on a word that began before the break; the first
            # engine would have named it and removed it from the output (_handle_sequence).
            for reason, word in self._stops.words:
                if tuple(self.ids[-len(word) :]) == word:
                    stop_reason = reason
                    if not self._stops.include:
                        trimmed = len(self.ids) - known
                        del self.ids[-len(word) :]
                        trimmed -= len(self.ids) - known
                    break
        before = len(self.text)
        self.text += self._decoder.decode(self.ids[known:])
        stopped = False
        if finish_reason is None or finish_reason in ("stop", "length"):
            for stop in self._stops.strings:
                at = self.text.find(stop)
                if at >= 0:
                    self.text = self.text[: at + len(stop) if self._stops.include else at]
                    stopped = finish_reason is None
                    finish_reason, stop_reason = "stop", stop
                    break
        return Step(
            text=self.text[before:],
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            stopped=stopped,
            trimmed=trimmed,
        )


def relayable(request: CompletionRequest | ChatCompletionRequest) -> bool:
    """Whether a request to ``trtllm-serve`` is streamed in token ids through the router. Not: an
    answer that is not streamed (retried whole when its worker fails, never migrated), and a
    completions request that asks for ``detokenize: false`` itself (passed as it is: its chunks
    carry their ids already)."""
    if not request.stream:
        return False
    return request.detokenize if isinstance(request, CompletionRequest) else True


def echoed(request: CompletionRequest | ChatCompletionRequest, tokenizer: HfPromptTokenizer) -> str:
    """The text ``trtllm-serve`` puts in front of the output with ``echo`` (``""``: none).

    Completions (``completion_stream_post_processor``): the prompt, in front of the first chunk's
    text. ``trtllm-serve`` prepends the prompt *as the request gave it*, so a token-id prompt makes
    its post-processor fail (a list added to a string); here it is the ids decoded as the output is.
    Chat (``openai_chat``, ``chat_stream_post_processor``): the last message's text when that
    message has the role of the answer (``assistant``, or the last message's own role without
    ``add_generation_prompt``) and some text, in a chunk of its own after the role header."""
    if not request.echo:
        return ""
    if isinstance(request, ChatCompletionRequest):
        last = request.messages[-1]
        return last.text() if last.role == _answer_role(request) else ""
    if isinstance(request.prompt, str):
        return request.prompt
    decoder = tokenizer.stream_decoder(skip_special_tokens=request.skip_special_tokens)
    return decoder.decode(request.prompt)


def _answer_role(request: ChatCompletionRequest) -> str:
    """The role of a chat's answer in ``trtllm-serve`` (``ChatPostprocArgs.role``)."""
    return "assistant" if request.add_generation_prompt else request.messages[-1].role


class TokenRelay:
    """One client stream served in token ids by ``trtllm-serve`` (see the module documentation)."""

    def __init__(
        self,
        *,
        request: CompletionRequest | ChatCompletionRequest,
        payload: dict[str, Any],
        tokens: TokenIds,
        tokenizer: HfPromptTokenizer,
    ) -> None:
        self.chat = isinstance(request, ChatCompletionRequest)
        self.body = self._engine_body(request, payload, tokens)
        """The engine request of the first attempt (continuations start from it)."""
        self.output = OutputText(
            tokenizer.stream_decoder(skip_special_tokens=request.skip_special_tokens),
            StopConditions.of(request, tokenizer),
        )
        options = request.stream_options
        self.include_usage = options is not None and options.include_usage
        self.continuous_usage = self.include_usage and options is not None and options.continuous_usage_stats
        self.role = _answer_role(request) if isinstance(request, ChatCompletionRequest) else "assistant"
        self.echo = echoed(request, tokenizer)
        """What ``echo`` puts in front of the output (written once, before the first text)."""
        self.trimmed = 0
        """Output tokens removed by the router (subtracted from the engine's usage)."""
        self._started = False

    def _engine_body(
        self, request: CompletionRequest | ChatCompletionRequest, payload: dict[str, Any], tokens: TokenIds
    ) -> dict[str, Any]:
        """The client's request as a token-id completions request with ``detokenize: false``."""
        body = {key: value for key, value in payload.items() if key not in _CHAT_ONLY_FIELDS}
        body.pop("echo", None)  # the router writes the echoed prompt itself
        if isinstance(request, ChatCompletionRequest) and (
            request.max_completion_tokens is not None or request.max_tokens is not None
        ):
            body["max_tokens"] = request.requested_tokens()
        body["prompt"] = tokens
        body["detokenize"] = False
        return body

    def translate(
        self, event: dict[str, Any], *, progress: StreamProgress
    ) -> tuple[list[dict[str, Any]], bool]:
        """The client's chunks for one engine chunk (its token ids already in ``progress``), and
        whether the stream ends here: a stop string found in the text that the engine did not stop
        on (the caller then writes ``[DONE]`` and drops the engine's stream, which aborts it)."""
        choices = event.get("choices") or []
        if not choices:
            return [self._usage_chunk(event, self._less_trimmed(event.get("usage")))], False
        choice = choices[0]
        step = self.output.feed(
            list(choice.get("token_ids") or ()),
            finish_reason=choice.get("finish_reason"),
            stop_reason=choice.get("stop_reason"),
            resumed=progress.migrations > 0,
        )
        self.trimmed += step.trimmed
        text = step.text
        out: list[dict[str, Any]] = []
        if self.chat:
            if not self._started:
                out.append(self._chat_header(event, {"role": self.role}))
                if self.echo:
                    out.append(self._chat_header(event, {"content": self.echo}))
            chat_choice: dict[str, Any] = {"index": choice.get("index", 0), "delta": {"content": text}}
            if step.finish_reason is not None:
                chat_choice["finish_reason"] = step.finish_reason
            if step.stop_reason is not None:
                chat_choice["stop_reason"] = step.stop_reason
            chunk = self._chat_chunk(event, [chat_choice])
        else:
            if not self._started:
                text = self.echo + text
            chunk = {
                **event,
                "choices": [
                    {
                        **choice,
                        "text": text,
                        "token_ids": None,
                        "finish_reason": step.finish_reason,
                        "stop_reason": step.stop_reason,
                    }
                ],
            }
        if isinstance(event.get("usage"), dict):
            chunk["usage"] = self._less_trimmed(event["usage"])
        out.append(chunk)
        self._started = True
        if step.stopped and self.include_usage:
            # As the engine of this attempt would count (the migration's rewrite gives the client's
            # view); its count of cached prompt tokens is unknown here and left out.
            prompt = len(progress.prompt) + progress.carried
            completion = len(progress.output) - progress.carried
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
            out.append(self._usage_chunk(event, usage))
        return out, step.stopped

    def _usage_chunk(self, event: dict[str, Any], usage: object) -> dict[str, Any]:
        if self.chat:
            return {**self._chat_chunk(event, []), "usage": usage}
        return {**event, "choices": [], "usage": usage}

    def _less_trimmed(self, usage: object) -> object:
        """The engine's usage less the tokens the router removed."""
        if not self.trimmed or not isinstance(usage, dict):
            return usage
        completion, total = usage.get("completion_tokens"), usage.get("total_tokens")
        if not isinstance(completion, int) or not isinstance(total, int):
            return usage
        return {**usage, "completion_tokens": completion - self.trimmed, "total_tokens": total - self.trimmed}

    def _chat_chunk(self, event: dict[str, Any], choices: list[dict[str, Any]]) -> dict[str, Any]:
        engine_id = str(event.get("id", ""))
        chunk: dict[str, Any] = {
            "id": f"chatcmpl-{engine_id.removeprefix('cmpl-')}",
            "object": "chat.completion.chunk",
            "created": event.get("created"),
            "model": event.get("model"),
            "choices": choices,
        }
        return chunk

    def _chat_header(self, event: dict[str, Any], delta: dict[str, str]) -> dict[str, Any]:
        """A chunk ``trtllm-serve`` writes before the output (``yield_first_chat``): the role, then
        the echoed last message."""
        header = self._chat_chunk(event, [{"index": 0, "delta": delta}])
        usage = event.get("usage")
        if self.continuous_usage and isinstance(usage, dict):
            prompt = usage.get("prompt_tokens")
            header["usage"] = {**usage, "completion_tokens": 0, "total_tokens": prompt}
        return header
