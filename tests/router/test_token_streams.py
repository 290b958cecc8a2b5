"""Streams to a real ``trtllm-serve`` (``engine: trtllm``) go in token ids and survive a dying worker:
the router asks for ``detokenize: false``, decodes the ids itself as ``trtllm-serve`` would, applies
stop strings as it would, and writes the chunks the client asked for (completions or chat). The
engines are fakes that stream exactly ``trtllm-serve``'s format (:mod:`tests.router.trtllm_fake`);
the expected text is ``transformers``' decoding of the same ids with the model's tokenizer."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from transformers import PreTrainedTokenizerBase

from copse.router.config import parse_config
from copse.router.frontend import RouterService
from copse.router.migration import MigrationReason
from copse.router.server import RunningRouter, start_router
from copse.router.token_streams import OutputText, StopConditions
from copse.router.tokens import HfPromptTokenizer
from copse.workers.protocol.openai_api import CompletionRequest

from .conftest import eventually
from .hf_models import engine_chat_ids, engine_completion_ids, engine_tokenizer, llama3_like
from .trtllm_fake import FakeTrtllm, Script, fake_trtllm

MODEL = "llama-like"
#: Multi-byte characters that the small BPE spells byte by byte (each split over several tokens),
#: a special token (skipped in the text), and plain words for the stop strings.
TEXT = "日本語 ✓ 🌲 the quick brown fox<|start_header_id|> jumps over the lazy dog 1234567890"
PROMPT = "Summarise the following document in three sentences."
CHAT = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama3_like(tmp_path_factory.mktemp("llama3"))


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> PreTrainedTokenizerBase:
    return engine_tokenizer(model_dir)


def _script(hf: PreTrainedTokenizerBase, *, chat: bool) -> Script:
    origin = (
        engine_chat_ids(hf, {"messages": CHAT}) if chat else engine_completion_ids(hf, {"prompt": PROMPT})
    )
    eos = hf.convert_tokens_to_ids("<|eot_id|>")
    assert isinstance(eos, int)
    return Script(
        tokens=list(hf.encode(TEXT, add_special_tokens=False)),
        origin=len(origin),
        eos=eos,
        encode_stop=lambda stop: list(hf.encode(stop, add_special_tokens=False)),
    )


def _decode(hf: PreTrainedTokenizerBase, ids: list[int]) -> str:
    text = hf.decode(ids, skip_special_tokens=True)
    assert isinstance(text, str)
    return text


class Fleet:
    def __init__(
        self, router: RunningRouter, engines: list[FakeTrtllm], script: Script, *, chat: bool
    ) -> None:
        self.router, self.engines, self.script, self.chat = router, engines, script, chat

    @property
    def requests(self) -> list[dict[str, Any]]:
        """What the engines received, in arrival order (whichever engine the router picked)."""
        return self.script.requests

    async def stream(self, body: dict[str, Any]) -> list[Any]:
        chat = self.chat
        path = "/v1/chat/completions" if chat else "/v1/completions"
        payload = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, **body}
        payload.setdefault("messages" if chat else "prompt", CHAT if chat else PROMPT)
        events: list[Any] = []
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{self.router.url}{path}", json=payload) as response,
        ):
            assert response.status == 200, await response.text()
            async for line in response.content:
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
        return events


@pytest.fixture
async def fleet(
    model_dir: Path, hf: PreTrainedTokenizerBase, request: pytest.FixtureRequest
) -> AsyncIterator[Fleet]:
    chat = getattr(request, "param", False)
    script = _script(hf, chat=chat)
    async with fake_trtllm(script) as first, fake_trtllm(script) as second:
        raw = {
            "model": MODEL,
            "engine": "trtllm",
            "tokenizer": str(model_dir),
            "kv_capacity_tokens": 100_000,
            "port": 0,
            "block_size": 4,
            "discovery": {"kind": "static", "workers": [{"url": first.url}, {"url": second.url}]},
            "health_interval_s": 0.05,
            "health_timeout_s": 0.2,
            "seed": 1,
        }
        router = await start_router(parse_config(raw, source="test"), router_id="test-router")
        try:
            await eventually(lambda: len(router.service.router.workers) == 2)
            yield Fleet(router, [first, second], script, chat=chat)
        finally:
            await router.close()


def _chunks(events: list[Any]) -> list[dict[str, Any]]:
    assert events[-1] == "[DONE]"
    assert not any("error" in event for event in events if isinstance(event, dict)), events
    return [event for event in events if isinstance(event, dict)]


def _text(events: list[Any]) -> str:
    text = ""
    for chunk in _chunks(events):
        for choice in chunk["choices"]:
            text += choice["text"] if "text" in choice else choice["delta"].get("content") or ""
    return text


def _finish(events: list[Any]) -> tuple[str, Any]:
    last = [chunk["choices"][0] for chunk in _chunks(events) if chunk["choices"]][-1]
    return last["finish_reason"], last.get("stop_reason")


def _usage(events: list[Any]) -> tuple[int, int]:
    usage = _chunks(events)[-1]["usage"]
    return usage["prompt_tokens"], usage["completion_tokens"]


def _migrations(fleet: Fleet) -> float:
    migrations = fleet.router.service.metrics.migrations
    return float(sum(migrations.labels(reason=reason.value)._value.get() for reason in MigrationReason))


# -- the decoder --------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_decoding_streamed_ids_gives_transformers_text(
    model_dir: Path, hf: PreTrainedTokenizerBase, chunk: int
) -> None:
    tokenizer = HfPromptTokenizer(model_dir)
    ids = list(hf.encode(TEXT, add_special_tokens=False))
    request = CompletionRequest.model_validate({"model": MODEL, "prompt": "x"})
    output = OutputText(
        tokenizer.stream_decoder(skip_special_tokens=True), StopConditions.of(request, tokenizer)
    )
    pieces = []
    for start in range(0, len(ids), chunk):
        pieces.append(
            output.feed(ids[start : start + chunk], finish_reason=None, stop_reason=None, resumed=False).text
        )
    assert "".join(pieces) == _decode(hf, ids) == TEXT.replace("<|start_header_id|>", "")
    # a chunk ending inside a character adds nothing until the character is whole
    first = OutputText(
        tokenizer.stream_decoder(skip_special_tokens=True), StopConditions.of(request, tokenizer)
    )
    assert first.feed(ids[:1], finish_reason=None, stop_reason=None, resumed=False).text == ""
    assert _decode(hf, ids[:1]) == "\N{REPLACEMENT CHARACTER}"
    special = OutputText(
        tokenizer.stream_decoder(skip_special_tokens=False), StopConditions.of(request, tokenizer)
    )
    assert special.feed(ids, finish_reason=None, stop_reason=None, resumed=False).text == TEXT


# -- migration ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fleet", [False, True], ids=["completions", "chat"], indirect=True)
@pytest.mark.parametrize("after", [1, 4, 14])  # inside 日, 本 and 🌲
async def test_a_broken_stream_goes_on_token_exactly_on_another_engine(
    fleet: Fleet, hf: PreTrainedTokenizerBase, after: int
) -> None:
    limit = 22  # up to " jumps", past the special token
    body = {"max_tokens": limit}
    unbroken = await fleet.stream(body)
    fleet.script.break_after = after
    broken = await fleet.stream(body)
    ids = fleet.script.tokens[:limit]
    assert _text(broken) == _text(unbroken) == _decode(hf, ids)
    assert _decode(hf, ids[:after]).endswith("\N{REPLACEMENT CHARACTER}")  # the break splits a character
    assert _migrations(fleet) == 1
    # what the engines were sent: token ids with detokenize false, then the streamed ids carried over
    first, second = fleet.requests[1:]
    origin = fleet.requests[0]["prompt"]
    assert len(origin) == fleet.script.origin
    assert first == {**first, "prompt": origin, "detokenize": False, "max_tokens": limit}
    assert second == {
        **second,
        "prompt": origin + ids[:after],
        "detokenize": False,
        "max_tokens": limit - after,
    }
    assert "messages" not in first
    chunks = _chunks(broken)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert _finish(broken) == ("length", None)
    assert _usage(broken) == _usage(unbroken) == (fleet.script.origin, limit)
    if fleet.chat:
        assert chunks[0]["id"].startswith("chatcmpl-")
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant"}}]
        assert sum(1 for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]) == 1
    else:
        assert all(c["choices"][0]["token_ids"] is None for c in chunks if c["choices"])
        assert chunks[0]["object"] == "text_completion"


@pytest.mark.parametrize(
    ("stop", "include", "reason"),
    [
        ("brown fox", False, "in the text only"),  # the model spells it " brown", " fox"
        (" brown fox", False, "as token ids"),  # exactly the model's tokens: the engine stops on them
        ("brown fox", True, "kept in the output"),
    ],
)
@pytest.mark.parametrize("fleet", [False, True], ids=["completions", "chat"], indirect=True)
async def test_a_stop_string_split_across_a_migration_stops_as_without_one(
    fleet: Fleet, hf: PreTrainedTokenizerBase, stop: str, include: bool, reason: str
) -> None:
    tokens = fleet.script.tokens
    fox = tokens.index(hf.convert_tokens_to_ids("Ġfox"))
    if reason == "as token ids":
        assert fleet.script.encode_stop(stop) == tokens[fox - 1 : fox + 1]
    else:
        assert fleet.script.encode_stop(stop) != tokens[fox - 1 : fox + 1]
    body = {"max_tokens": 30, "stop": [stop], "include_stop_str_in_output": include}
    unbroken = await fleet.stream(body)
    fleet.script.break_after = fox  # the first engine streams up to " brown"
    broken = await fleet.stream(body)
    assert _migrations(fleet) == 1
    assert _text(broken) == _text(unbroken)
    assert _finish(broken) == _finish(unbroken) == ("stop", stop)
    assert _usage(broken) == _usage(unbroken)
    # trtllm-serve streamed " brown" before it saw the stop; what follows it is cut
    streamed = _decode(hf, tokens[:fox])
    assert _text(broken) == (streamed + " fox" if include else streamed)
    generated = fox + 1 - (2 if reason == "as token ids" else 0)  # the engine removes the stop's ids
    assert _usage(broken) == (fleet.script.origin, generated)


@pytest.mark.parametrize("as_ids", [False, True], ids=["text prompt", "token-id prompt"])
@pytest.mark.parametrize("after", [None, 4])
async def test_echo_puts_the_prompt_in_front_of_the_first_text(
    fleet: Fleet, hf: PreTrainedTokenizerBase, as_ids: bool, after: int | None
) -> None:
    """trtllm-serve prepends the prompt text to the first chunk with echo; with detokenize false
    it cannot, so the router does (a token-id prompt decoded as the output is: trtllm-serve itself
    fails on one), once, also when the stream moves to another engine; the engines are not asked
    to echo."""
    prompt: str | list[int] = engine_completion_ids(hf, {"prompt": PROMPT}) if as_ids else PROMPT
    fleet.script.break_after = after
    events = await fleet.stream({"max_tokens": 22, "echo": True, "prompt": prompt})
    assert _migrations(fleet) == (0 if after is None else 1)
    assert _text(events) == PROMPT + _decode(hf, fleet.script.tokens[:22])
    if as_ids:
        assert isinstance(prompt, list)
        assert prompt[0] == hf.bos_token_id  # skipped in the echo as in the output
    assert _chunks(events)[0]["choices"][0]["text"].startswith(PROMPT)
    assert all("echo" not in body for body in fleet.requests)
    assert _usage(events) == (fleet.script.origin, 22)


@pytest.mark.parametrize("fleet", [True], ids=["chat"], indirect=True)
@pytest.mark.parametrize(
    ("last", "generation_prompt", "role"),
    [
        ("assistant", False, "assistant"),
        ("assistant", True, "assistant"),
        ("user", False, "user"),
        ("user", True, None),
    ],
)
async def test_chat_echo_repeats_the_last_message_of_the_answers_role(
    fleet: Fleet, hf: PreTrainedTokenizerBase, last: str, generation_prompt: bool, role: str | None
) -> None:
    """trtllm-serve's chat echo: the last message's text, in a chunk of its own after the role
    header, when that message has the answer's role (``assistant``, or the last message's role
    without the generation prompt); nothing otherwise."""
    started = "The fox"
    messages = [*CHAT, {"role": last, "content": [{"type": "text", "text": started}]}]
    body = {"max_tokens": 22, "echo": True, "messages": messages, "add_generation_prompt": generation_prompt}
    fleet.script.origin = len(engine_chat_ids(hf, body))
    events = await fleet.stream(body)
    chunks = _chunks(events)
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": role or "assistant"}}]
    generated = _decode(hf, fleet.script.tokens[:22])
    if role is None:
        assert _text(events) == generated
    else:
        assert chunks[1]["choices"] == [{"index": 0, "delta": {"content": started}}]
        assert _text(events) == started + generated
    assert "echo" not in fleet.requests[0]
    assert fleet.requests[0]["prompt"] == engine_chat_ids(hf, body)


async def test_a_client_gone_mid_stream_aborts_the_request_on_trtllm_serve(fleet: Fleet) -> None:
    """The router closes its connection to the engine when the client goes, which is what makes
    ``trtllm-serve`` abort the request and free its slot."""
    fleet.script.pace_s = 0.05
    payload = {"model": MODEL, "stream": True, "prompt": PROMPT, "max_tokens": 200}
    async with aiohttp.ClientSession() as http:
        response = await http.post(f"{fleet.router.url}/v1/completions", json=payload)
        assert response.status == 200
        await response.content.readline()  # the first event arrived: the engine is generating
        response.close()  # the client goes away mid-stream
    await eventually(lambda: fleet.script.aborted == [0])
    service = fleet.router.service
    assert isinstance(service, RouterService)
    await eventually(lambda: service.router.sequences.requests.sum() == 0)
    assert service.clients.clients() == 0
