"""The router tokenizes exactly as the engine does: copse's byte tokenizer for mocked engines, and
for ``trtllm-serve`` the model's ``tokenizer.json`` and chat template, checked against the engine
side replayed with ``transformers`` (see :mod:`tests.router.hf_models`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from copse.router.config import parse_config
from copse.router.tokens import HfPromptTokenizer, MockPromptTokenizer, load_tokenizer, prompt_tokens
from copse.workers.protocol.hashing import block_hashes
from copse.workers.protocol.openai_api import ChatCompletionRequest, CompletionRequest, RequestError
from copse.workers.protocol.tokenizer import encode, render_chat

from .hf_models import (
    engine_chat_ids,
    engine_completion_ids,
    engine_tokenizer,
    llama2_like,
    llama3_like,
)

BLOCK = 4
LONG = " ".join(
    ["KV cache aware routing sends each request to the engine that already holds its prefix."] * 6
)

CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hello, world!"}]},
    {"messages": [{"role": "system", "content": "  Answer briefly.  "}, {"role": "user", "content": LONG}]},
    {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Summarise"}, {"type": "text", "text": LONG}],
            },
            {"role": "assistant", "content": "The quick brown fox."},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "Ünïcödé 🦊, then numbers 1234567890."},
        ]
    },
    {"messages": [{"role": "user", "content": "no generation prompt"}], "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "a BOS on top"}], "add_special_tokens": True},
    {
        "messages": [{"role": "user", "content": "kwargs"}],
        "chat_template_kwargs": {"default_system": "Be terse."},
    },
    {
        "messages": [{"role": "user", "content": "with documents"}],
        "documents": [{"title": "Fuchs", "text": "Der schnelle braune Fuchs — «ünïcödé»"}],
    },
    {
        "messages": [{"role": "user", "content": "named template"}],
        "chat_template": "rag",
        "documents": [{"text": "d"}],
    },
    {
        "messages": [{"role": "user", "content": "inline template"}],
        "chat_template": "{{ messages[0].content }}!",
    },
]


def _chat(body: dict[str, Any]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", **body})


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama3_like(tmp_path_factory.mktemp("llama3"))


@pytest.mark.parametrize("body", CHATS, ids=range(len(CHATS)))
def test_chat_hashes_equal_the_engines(llama3: Path, body: dict[str, Any]) -> None:
    router = HfPromptTokenizer(llama3)
    engine = engine_tokenizer(llama3)
    expected = engine_chat_ids(engine, body)
    tokens = prompt_tokens(_chat(body), router)
    assert tokens == tuple(expected)
    assert block_hashes(tokens, block_size=BLOCK) == block_hashes(expected, block_size=BLOCK)
    assert len(expected) > BLOCK  # the prompt spans blocks: the hashes compare something


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": LONG},
        {"prompt": "Ünïcödé 🦊 <|eot_id|> inside text", "add_special_tokens": False},
        {"prompt": [7, 8, 9, 10, 11]},
    ],
    ids=["text", "no-special-tokens", "token-ids"],
)
def test_completion_hashes_equal_the_engines(llama3: Path, body: dict[str, Any]) -> None:
    router = HfPromptTokenizer(llama3)
    expected = engine_completion_ids(engine_tokenizer(llama3), body)
    tokens = prompt_tokens(CompletionRequest.model_validate({"model": "m", **body}), router)
    assert tokens == tuple(expected)
    if isinstance(body["prompt"], str) and body.get("add_special_tokens", True):
        assert tokens[0] == router._tokenizer.token_to_id("<|begin_of_text|>")  # BOS from the post-processor


def test_a_chat_template_file_takes_priority_over_the_config(tmp_path: Path) -> None:
    directory = llama3_like(tmp_path / "m", template_file=True)
    router, engine = HfPromptTokenizer(directory), engine_tokenizer(directory)
    body = CHATS[1]
    assert prompt_tokens(_chat(body), router) == tuple(engine_chat_ids(engine, body))
    assert "rag" not in router.templates  # the file replaces the config's named templates, as in transformers


def test_llama_class_adds_bos_from_the_config(tmp_path: Path) -> None:
    """LlamaTokenizerFast rebuilds the post-processor from add_bos_token: BOS appears although
    tokenizer.json has no post-processor."""
    directory = llama2_like(tmp_path / "m")
    router, engine = HfPromptTokenizer(directory), engine_tokenizer(directory)
    completion = {"prompt": LONG}
    tokens = prompt_tokens(CompletionRequest.model_validate({"model": "m", **completion}), router)
    assert tokens == tuple(engine_completion_ids(engine, completion))
    assert tokens[0] == router._tokenizer.token_to_id("<s>")
    for body in (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True},
    ):
        assert prompt_tokens(_chat(body), router) == tuple(engine_chat_ids(engine, body))


def test_the_template_refusing_a_chat_is_a_request_error(llama3: Path) -> None:
    router = HfPromptTokenizer(llama3)
    with pytest.raises(RequestError, match="Conversation roles must be user or assistant") as refused:
        prompt_tokens(_chat({"messages": [{"role": "tool", "content": "x"}]}), router)
    assert refused.value.param == "messages"
    with pytest.raises(RequestError, match="not valid Jinja") as broken:
        prompt_tokens(
            _chat({"messages": [{"role": "user", "content": "x"}], "chat_template": "{% if %}"}), router
        )
    assert broken.value.param == "chat_template"


def test_unusable_model_directories_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        HfPromptTokenizer(tmp_path)
    directory = llama3_like(tmp_path / "m")
    with pytest.raises(ValueError, match="is a file; give the model directory"):
        HfPromptTokenizer(directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(ValueError, match="is not valid Jinja"):
        HfPromptTokenizer(directory)
    (directory / "tokenizer_config.json").write_text("{}")
    bare = HfPromptTokenizer(directory)  # a base model: completions work, chats are refused
    assert prompt_tokens(CompletionRequest(model="m", prompt="fox"), bare)
    with pytest.raises(RequestError, match="has no chat template"):
        prompt_tokens(_chat({"messages": [{"role": "user", "content": "x"}]}), bare)


def test_mocked_engines_keep_the_byte_tokenizer() -> None:
    config = parse_config(
        {"model": "m", "engine": "mock", "discovery": {"kind": "static", "workers": [{"url": "http://h:1"}]}},
        source="t",
    )
    tokenizer = load_tokenizer(config)
    assert isinstance(tokenizer, MockPromptTokenizer)
    assert prompt_tokens(CompletionRequest(model="m", prompt=(5, 6, 7)), tokenizer) == (5, 6, 7)
    assert prompt_tokens(CompletionRequest(model="m", prompt="Hello, world"), tokenizer) == tuple(
        encode("Hello, world")
    )
    chat = _chat({"messages": [{"role": "user", "content": "hi"}]})
    assert prompt_tokens(chat, tokenizer) == tuple(encode(render_chat([("user", "hi")])))
    bare = _chat({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False})
    assert prompt_tokens(bare, tokenizer) == tuple(encode("<|user|>\nhi\n"))


def test_load_tokenizer_names_the_field(tmp_path: Path) -> None:
    config = parse_config(
        {
            "model": "m",
            "engine": "trtllm",
            "tokenizer": str(tmp_path),
            "kv_capacity_tokens": 1000,
            "discovery": {"kind": "static", "workers": [{"url": "http://h:1"}]},
        },
        source="t",
    )
    with pytest.raises(ValueError, match=r"^tokenizer: .*no tokenizer\.json"):
        load_tokenizer(config)


def test_a_hub_cache_folder_resolves_to_the_snapshot_its_main_ref_names(llama3: Path, tmp_path: Path) -> None:
    """The examples point spec.router.tokenizer at ``hub/models--<org>--<name>`` on the model cache:
    the router reads the revision from ``refs/main`` as huggingface_hub does."""
    folder = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B-Instruct"
    snapshot = folder / "snapshots" / "0123abcd"
    snapshot.parent.mkdir(parents=True)
    snapshot.symlink_to(llama3, target_is_directory=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0123abcd")
    request = CompletionRequest.model_validate({"model": "m", "prompt": "Hello there"})
    via_cache = prompt_tokens(request, HfPromptTokenizer(folder))
    assert via_cache == prompt_tokens(request, HfPromptTokenizer(llama3))
    (folder / "refs" / "main").write_text("feedbeef")
    with pytest.raises(
        ValueError, match=r"refs/main names revision 'feedbeef', but there is no .*/snapshots/feedbeef"
    ):
        HfPromptTokenizer(folder)
