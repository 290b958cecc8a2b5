"""Turning a request's prompt into the token ids the engine will cache.

Token-id prompts pass through unchanged. Text is tokenized with the tokenizer configured for the
model (a Hugging Face ``tokenizer.json`` read by the ``tokenizers`` package), or, without one,
exactly as copse's mocked engines tokenize (:mod:`copse.workers.protocol.tokenizer`: words and
punctuation hashed to ids), so that the router's block hashes equal the mocker's. Chat messages
are rendered with the mocked engines' template before tokenizing; for a real model whose chat
template differs, only the routing estimate suffers (the engine renders the chat itself).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as HfTokenizer

from copse.workers.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from copse.workers.protocol.tokenizer import encode, render_chat


class Tokenizer(Protocol):
    """Text to token ids."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        ...


class MockTokenizer:
    """The mocked engines' tokenizer."""

    def encode(self, text: str) -> list[int]:
        return encode(text)


class FileTokenizer:
    """A Hugging Face ``tokenizer.json``, read with the ``tokenizers`` package."""

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise ValueError(f"tokenizer {path}: no such file")
        try:
            self._tokenizer = HfTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises its own exception type
            raise ValueError(f"tokenizer {path}: cannot load ({exc})") from exc

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text).ids)


def load_tokenizer(path: Path | None) -> Tokenizer:
    """The configured tokenizer, or the mocked engines' one without a file. Raises ``ValueError``."""
    return MockTokenizer() if path is None else FileTokenizer(path)


def prompt_tokens(request: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer) -> list[int]:
    """The token ids the engine will see for ``request``'s prompt."""
    if isinstance(request, ChatCompletionRequest):
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        return tokenizer.encode(render_chat((message.role, message.text()) for message in request.messages))
    if isinstance(request.prompt, str):
        return tokenizer.encode(request.prompt)
    return list(request.prompt)
