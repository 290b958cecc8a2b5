"""Prompt tokenization: token ids pass through, text uses the model's tokenizer file or the mock's."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from copse.router.tokens import FileTokenizer, MockTokenizer, load_tokenizer, prompt_tokens
from copse.workers.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from copse.workers.protocol.tokenizer import encode, render_chat


def test_token_ids_pass_through_and_text_matches_the_mocked_engines() -> None:
    tokenizer = load_tokenizer(None)
    assert isinstance(tokenizer, MockTokenizer)
    ids = CompletionRequest(model="m", prompt=[5, 6, 7])
    assert prompt_tokens(ids, tokenizer) == [5, 6, 7]
    text = CompletionRequest(model="m", prompt="Hello, world")
    assert prompt_tokens(text, tokenizer) == encode("Hello, world")
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert prompt_tokens(chat, tokenizer) == encode(render_chat([("user", "hi")]))


def test_a_tokenizer_file_is_used_for_text(tmp_path: Path) -> None:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    tokenizer = load_tokenizer(path)
    assert isinstance(tokenizer, FileTokenizer)
    assert prompt_tokens(CompletionRequest(model="m", prompt="hello world again"), tokenizer) == [1, 2, 0]
    with pytest.raises(ValueError, match="no such file"):
        load_tokenizer(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{}")
    with pytest.raises(ValueError, match=r"broken\.json: cannot load"):
        load_tokenizer(broken)
