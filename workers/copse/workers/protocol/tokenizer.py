"""The deterministic tokenizer and chat template of mocked engines.

A router must turn a text prompt into exactly the token ids the engine will cache, so both use
the functions here when the engine is a mocker (a router in front of a real ``trtllm-serve``
uses the model's own tokenizer and chat template instead: :mod:`copse.router.tokens`).
Mocked engines accept but ignore a request's ``chat_template``, ``chat_template_kwargs``,
``documents`` and ``add_special_tokens`` (this tokenizer has no special tokens).

* :func:`encode`: words (``\\w+``) and single punctuation characters are tokens; a token's id is
  ``RESERVED_IDS + XXH3-64(utf-8 bytes, seed 1337) % (VOCAB_SIZE - RESERVED_IDS)``.
* :func:`render_chat`: ``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n`` (the
  generation prompt, unless a request asks for none).
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


def render_chat(messages: Iterable[tuple[str, str]], *, add_generation_prompt: bool = True) -> str:
    """The prompt text of a chat given as ``(role, content)`` pairs, ready for the assistant's turn
    when ``add_generation_prompt``."""
    turns = "".join(f"<|{role}|>\n{content}\n" for role, content in messages)
    return turns + ("<|assistant|>\n" if add_generation_prompt else "")


def chat_tokens(turns: Iterable[tuple[str, str]], *, add_generation_prompt: bool) -> list[int]:
    """Token ids of a chat given as ``(role, content)`` pairs: what a mocked engine caches."""
    return encode(render_chat(turns, add_generation_prompt=add_generation_prompt))


def token_text(token_id: int) -> str:
    """Text of one generated token: a space and a word."""
    return " " + _LEXICON[token_id % len(_LEXICON)]
