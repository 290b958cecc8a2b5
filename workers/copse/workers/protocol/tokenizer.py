"""The deterministic tokenizer and chat template of mocked engines.

A router must turn a text prompt into exactly the token ids the engine will cache, so both use
the functions here when the engine is a mocker (a real ``trtllm-serve`` needs its model's own
tokenizer; send token-id prompts to avoid the question).

* :func:`encode`: words (``\\w+``) and single punctuation characters are tokens; a token's id is
  ``RESERVED_IDS + XXH3-64(utf-8 bytes, seed 1337) % (VOCAB_SIZE - RESERVED_IDS)``.
* :func:`render_chat`: ``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``.
* :func:`token_text`: the text a mocked engine emits for a generated id (from a small lexicon;
  not the inverse of :func:`encode`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import xxhash

from copse.workers.protocol.hashing import HASH_SEED

VOCAB_SIZE = 32000
"""Token ids lie in ``[0, VOCAB_SIZE)``."""
RESERVED_IDS = 256
"""Ids below this are never produced by :func:`encode` (room for special tokens)."""

_PIECES = re.compile(r"\w+|[^\w\s]")
_LEXICON = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "it",
    "for",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "at",
    "this",
    "from",
    "or",
    "an",
    "are",
    "not",
    "have",
    "but",
    "which",
    "one",
    "all",
    "were",
    "they",
    "we",
    "can",
    "more",
    "has",
    "their",
    "been",
    "there",
    "when",
    "so",
    "if",
    "out",
    "some",
    "would",
    "what",
    "up",
    "time",
    "into",
    "only",
    "other",
    "new",
    "these",
    "about",
    "could",
    "two",
    "may",
    "first",
    "then",
    "do",
    "any",
    "like",
    "my",
    "now",
    "over",
    "such",
    "our",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
)


def encode(text: str) -> list[int]:
    """Token ids of ``text``."""
    span = VOCAB_SIZE - RESERVED_IDS
    return [
        RESERVED_IDS + xxhash.xxh3_64_intdigest(piece.encode(), seed=HASH_SEED) % span
        for piece in _PIECES.findall(text)
    ]


def render_chat(messages: Iterable[tuple[str, str]]) -> str:
    """The prompt text of a chat given as ``(role, content)`` pairs, ready for the assistant's turn."""
    return "".join(f"<|{role}|>\n{content}\n" for role, content in messages) + "<|assistant|>\n"


def token_text(token_id: int) -> str:
    """Text of one generated token: a space and a word."""
    return " " + _LEXICON[token_id % len(_LEXICON)]
