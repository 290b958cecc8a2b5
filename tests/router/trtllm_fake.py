"""A fake ``trtllm-serve`` for router tests: ``/v1/completions`` streamed with ``detokenize: false``
exactly as TensorRT-LLM writes it, generating a fixed script of token ids.

What it reproduces, from TensorRT-LLM's sources:

* request: ``serve/openai_protocol.py`` ``CompletionRequest`` forbids unknown fields (400);
* chunks: ``serve/postprocess_handlers.py`` ``completion_stream_post_processor`` with
  ``detokenize`` false: every field of ``CompletionStreamResponse`` (``exclude_unset=False``),
  ``text: ""``, ``token_ids`` the new ids, one chunk per generated token (stream interval 1); the
  usage chunk when ``stream_options.include_usage`` and the request is done; ``data: [DONE]``;
* stop words: ``SamplingParams._setup`` encodes each stop string with the engine's tokenizer
  (``add_special_tokens=False``); the PyTorch sampler stops when the request's last tokens (prompt
  *and* output) equal a stop word; ``GenerationResultBase._handle_sequence`` looks for the word at
  the end of the *output* only, names it in ``stop_reason`` and removes it (unless
  ``include_stop_str_in_output``); no text-level stop matching (``detokenize`` is false);
* the end-of-sequence token finishes with ``stop`` and is not part of the output.

The script: the token after a sequence of ``n`` tokens is ``script[n - origin]`` (``origin``: the
length of the original prompt), so a continuation carrying streamed ids as prompt goes on with the
same tokens, as a real model with greedy sampling would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

#: ``CompletionRequest`` fields of ``trtllm-serve`` (``serve/openai_protocol.py``): anything else is a 400.
TRTLLM_COMPLETION_FIELDS = frozenset(
    {
        "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens",
        "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
        "top_p", "user", "lora_request", "prompt_ignore_length", "use_beam_search", "top_k", "top_p_min",
        "min_p", "repetition_penalty", "length_penalty", "early_stopping", "stop_token_ids",
        "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
        "spaces_between_special_tokens", "truncate_prompt_tokens", "return_context_logits", "detokenize",
        "thinking_token_budget", "add_special_tokens", "response_format", "disaggregated_params",
        "priority", "conversation_params",
    }
)  # fmt: skip


@dataclass
class Script:
    """What the fake engines generate, and the fault to inject (shared by a test's engines)."""

    tokens: list[int]
    origin: int
    """Length of the original prompt: the token after ``n`` tokens is ``tokens[n - origin]``."""
    eos: int
    encode_stop: Callable[[str], list[int]]
    """The engine's encoding of a stop string."""
    break_after: int | None = None
    """The next request served (by any engine) drops its connection after this many output chunks."""
    requests: list[dict[str, Any]] = field(default_factory=list)
    """The bodies every engine of the script received, in the order they arrived."""
    pace_s: float = 0.0
    """Pause before each output chunk (a real engine's decode step)."""
    aborted: list[int] = field(default_factory=list)
    """Requests (their index in ``requests``) aborted because their client went away, as
    ``trtllm-serve`` aborts a request whose connection closed."""


@dataclass
class FakeTrtllm:
    script: Script
    url: str = ""

    def next_token(self, sequence: list[int]) -> int:
        at = len(sequence) - self.script.origin
        return self.script.tokens[at] if at < len(self.script.tokens) else self.script.eos


def _chunk(rid: str, created: int, model: str, **choice: Any) -> bytes:
    body = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": "",
                "token_ids": choice["token_ids"],
                "logprobs": None,
                "finish_reason": choice.get("finish_reason"),
                "stop_reason": choice.get("stop_reason"),
                "avg_decoded_tokens_per_iter": None,
            }
        ],
        "usage": None,
    }
    return f"data: {json.dumps(body)}\n\n".encode()


@contextlib.asynccontextmanager
async def fake_trtllm(script: Script) -> AsyncIterator[FakeTrtllm]:
    state = FakeTrtllm(script=script)

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        index = len(state.script.requests)
        state.script.requests.append(body)
        unknown = sorted(set(body) - TRTLLM_COMPLETION_FIELDS)
        if unknown:
            error = {
                "object": "error",
                "message": f"extra fields {unknown}",
                "type": "BadRequestError",
                "code": 400,
            }
            return web.json_response(error, status=400)
        assert body.get("stream"), "the fake serves streams only"
        assert body.get("detokenize") is False, "the fake serves token ids only"
        prompt = body["prompt"]
        assert isinstance(prompt, list), "the router sends token ids"
        stop = body.get("stop") or []
        strings = [stop] if isinstance(stop, str) else stop
        words: list[tuple[str | int, list[int]]] = [(t, [t]) for t in body.get("stop_token_ids") or []]
        words += [(s, script.encode_stop(s)) for s in strings]
        include = bool(body.get("include_stop_str_in_output"))
        max_tokens = body.get("max_tokens") or 32
        rid, created, model = f"cmpl-{len(state.script.requests)}", int(time.time()), body["model"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        breaks, script.break_after = script.break_after, None
        sequence, output = list(prompt), list[int]()
        finish, stop_reason = None, None
        while finish is None:
            token = state.next_token(sequence)
            known = len(output)
            if token == script.eos:
                finish = "stop"
            else:
                sequence.append(token)
                output.append(token)
                if any(sequence[-len(ids) :] == ids for _, ids in words):  # the sampler: prompt and output
                    finish = "stop"
                    for reason, ids in words:  # _handle_sequence: the output's own end only
                        if output[-len(ids) :] == ids:
                            stop_reason = reason
                            if not include:
                                del output[-len(ids) :]
                            break
                elif len(output) >= max_tokens:
                    finish = "length"
            if breaks is not None and known >= breaks:
                assert request.transport is not None
                request.transport.close()
                return response
            if script.pace_s:
                await asyncio.sleep(script.pace_s)
            try:
                await response.write(
                    _chunk(
                        rid,
                        created,
                        model,
                        token_ids=output[known:],
                        finish_reason=finish,
                        stop_reason=stop_reason,
                    )
                )
            except ConnectionResetError:
                script.aborted.append(index)
                return response
        options = body.get("stream_options") or {}
        if options.get("include_usage", True) and body.get("stream_options") is not None:
            usage = {
                "prompt_tokens": len(prompt),
                "total_tokens": len(prompt) + len(output),
                "completion_tokens": len(output),
                "prompt_tokens_details": {"cached_tokens": 0},
            }
            final = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage,
            }
            await response.write(f"data: {json.dumps(final)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.add_routes([web.get("/health", health), web.post("/v1/completions", completions)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    state.url = f"http://{host}:{port}"
    try:
        yield state
    finally:
        await runner.cleanup()
